"""The MaxText side of benchmarks/loss_parity.py, run by the interpreter that has MaxText installed.

    PY benchmarks/maxtext_side.py data --input 'DIR/*.arrayrecord' --output-dir OUT
    PY benchmarks/maxtext_side.py init --hf-dir HF --output-dir OUT [maxtext key=value ...]

`data`: this trainer's prepared text shards (ArrayRecord of JSON records with a "text" field, what
`python -m trainer.data.prepare` writes without --tokenizer) rewritten as the ArrayRecord of serialized
tf.train.Example protos with a bytes feature "text" that MaxText's Grain pipeline reads
(`dataset_type=grain grain_file_type=arrayrecord`): the same documents in the same order, one shard per
input shard. MaxText then tokenizes them with its own tokenizer code.

`init`: a Hugging Face checkpoint converted by MaxText's own converter
(`maxtext.checkpoint_conversion.to_maxtext`) into a params-only checkpoint that MaxText's
`load_parameters_path` reads. The converter knows published shapes only, by model name, so it is told
the checkpoint's own `config.json` under the `qwen3-0.6b` entry (the Qwen3 mapping it uses is
shape-generic) and given the matching `key=value` model overrides. Its own save wraps the weights in a
Flax TrainState that Orbax 0.12's v1 API refuses; the weights it converted are saved instead with
MaxText's params-only writer (`checkpointing.save_params_to_path`), the layout its loader reads.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path


def data(pattern: str, output_dir: str) -> int:
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
    from maxtext.input_pipeline.protos import example_pb2

    files = sorted(glob.glob(pattern))
    if not files:
        sys.exit(f"no shards match {pattern!r}")
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    n = 0
    for i, path in enumerate(files):
        reader = ArrayRecordReader(path)
        writer = ArrayRecordWriter(f"{output_dir}/text-{i:05d}-of-{len(files):05d}.array_record", "group_size:1")
        for k in range(reader.num_records()):
            record = json.loads(reader.read([k])[0])
            if "text" not in record:
                sys.exit(f"{path} record {k}: no 'text' field (prepare the corpus without --tokenizer)")
            example = example_pb2.Example()
            example.features.feature["text"].bytes_list.value.append(record["text"].encode())
            writer.write(example.SerializeToString())
            n += 1
        writer.close()
        reader.close()
    return n


def init(hf_dir: str, output_dir: str, overrides: list[str]) -> None:
    import jax
    import maxtext
    import numpy as np
    import transformers
    from maxtext.checkpoint_conversion import to_maxtext
    from maxtext.common import checkpointing

    to_maxtext.HF_MODEL_CONFIGS["qwen3-0.6b"] = transformers.AutoConfig.from_pretrained(hf_dir)

    def save(_path, jax_weights, _device_count, use_ocdbt, use_zarr3, config=None):
        wrapped = isinstance(jax_weights, dict) and "params" in jax_weights
        params = jax_weights if wrapped else {"params": jax_weights}
        params = jax.tree.map(np.asarray, params)  # the converter's lazily read tensors, materialized
        checkpointing.save_params_to_path(output_dir, params, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)

    to_maxtext.save_weights_to_checkpoint = save
    root = os.path.dirname(maxtext.__file__)
    argv = [sys.argv[0], f"{root}/configs/base.yml", "model_name=qwen3-0.6b", "override_model_config=true"]
    argv += [f"base_output_directory={output_dir}.convert", "run_name=init", "hardware=cpu"]
    argv += ["skip_jax_distributed_system=true", *overrides]
    to_maxtext.main(argv, lazy_load_tensors=True, hf_model_path=hf_dir, save_dtype="float32")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--input", required=True)
    d.add_argument("--output-dir", required=True)
    i = sub.add_parser("init")
    i.add_argument("--hf-dir", required=True)
    i.add_argument("--output-dir", required=True)
    i.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.cmd == "data":
        print(data(args.input, args.output_dir))
    else:
        init(args.hf_dir, args.output_dir, args.overrides)


if __name__ == "__main__":
    main()
