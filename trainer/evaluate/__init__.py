"""EleutherAI's lm-evaluation-harness on checkpoints of this trainer: `python -m trainer.evaluate`.

    cli.py        the command line: arguments, the exit-code contract, the results table and JSON
    harness.py    lm-eval's side: the package present, tasks found (local --include-path first), run
    lm.py         lm-eval's model interface (TemplateLM), registered as "elastic-trainer"
    backend.py    a checkpoint opened for evaluation: tokenizer, scorer and generator on the mesh
    source.py     which checkpoint a path names, and the config it records (model, tokenizer, mesh)
    placement.py  the mesh over the local devices and the params restored onto their shardings
    batching.py   requests laid out in a fixed set of shapes (rows x power-of-two lengths)
    scoring.py    continuation log-likelihoods and greedy flags, reduced on the device
    greedy.py     greedy continuations of prompts of mixed lengths on the model's KV cache
    stops.py      when a continuation is finished and the text lm-eval gets from it
    text.py       the checkpoint's tokenizer: encode, decode with or without special tokens

Only lm.py, harness.py and cli.py import lm-eval (the optional `eval` extra); the rest runs without it.
"""
