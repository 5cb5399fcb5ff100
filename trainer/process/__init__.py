"""What one trainer process watches over for its whole life, below everything that runs in it.

`preemption` (SIGTERM in every phase: `StopSignal`, `Preempted`, the main thread's `Phases`), `watchdog`
(the progress watchdog). The process root that owns one of each is `trainer/process_root.py`.
"""
