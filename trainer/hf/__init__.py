"""Hugging Face checkpoints read and written (Qwen3, Qwen3-MoE, Llama 3): the library behind
`python -m trainer.convert`.

The name and layout mapping itself (config.json <-> ModelConfig, the tensor plan) is each family's
(`trainer/model/<family>/hf.py`, picked by `trainer/model/hf.py`), pure and next to the model; the modules
here do the file I/O around it, whatever the family:

    errors.py          MissingInput and the error helpers the readers share
    safetensors_io.py  *.safetensors directories: headers checked up front, tensors read and written one at a time
    load.py            a Hugging Face directory -> ModelConfig + params (config.json and headers checked first)
    checkpoints.py     this trainer's side: a checkpoint's model config, its params read, params saved
    outputs.py         an output path checked before any heavy work
    to_trainer.py      hf-to-trainer: params-only checkpoint + model.yml
    to_hf.py           trainer-to-hf: config.json + (sharded) safetensors
    logits.py          token ids read and checked, float32 logits of a checkpoint or HF directory

Nothing is imported here, so `import trainer.hf.<module>` loads only what that module needs.
"""
