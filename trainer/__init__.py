"""Elastic Qwen3 trainer. Importing the package first keeps an installed-but-idle libtpu from starting a
TPU backend on machines without a TPU (see trainer/backends.py)."""

from trainer.backends import pin_cpu_without_tpu

pin_cpu_without_tpu()
