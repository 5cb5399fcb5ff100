"""hf-to-trainer: a Hugging Face directory -> a params-only checkpoint to train from, plus its model.yml.

The output directory holds the checkpoint (load_parameters_path=O), model.yml (the model config derived
from config.json, model=O/model.yml), hf_config.json (the source config.json) and tokenizer.json when the
source has one. Each param leaf is allocated once and filled from memory-mapped safetensors, then saved
in place; everything is built aside and appears only when complete.
"""

from __future__ import annotations

from pathlib import Path

from trainer.config.schema import ARCHITECTURE_KEYS, MOE_ARCHITECTURE_KEYS
from trainer.hf.checkpoints import save_params
from trainer.hf.load import load_hf
from trainer.hf.outputs import check_output
from trainer.io.paths import resolve
from trainer.io.staging import staged_dir


def hf_to_trainer(
    hf_dir,
    output_dir,
    *,
    dtype: str | None = None,
    weight_dtype: str = "float32",
    scan_layers: bool = True,
    moe_capacity_factor: float | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the params-only checkpoint + model.yml of a Hugging Face directory; returns output_dir.

    Order: output writable, config.json and every safetensors header checked, then the tensors read and
    written aside; the output appears (or replaces the old one, with overwrite) only when complete."""
    hf_dir = resolve(hf_dir)
    output_dir = check_output(output_dir, overwrite=overwrite, flag="--output-dir", inputs=[hf_dir])
    cfg, params = load_hf(
        hf_dir,
        dtype=dtype,
        weight_dtype=weight_dtype,
        scan_layers=scan_layers,
        moe_capacity_factor=moe_capacity_factor,
    )
    with staged_dir(output_dir, overwrite=overwrite) as staging:
        save_params(staging, params)
        del params
        tokenizer = None
        if (hf_dir / "tokenizer.json").is_file():
            (staging / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
            tokenizer = output_dir / "tokenizer.json"
        (staging / "hf_config.json").write_bytes((hf_dir / "config.json").read_bytes())
        yml = model_yaml(cfg, source=hf_dir, output_dir=output_dir, tokenizer=tokenizer)
        (staging / "model.yml").write_text(yml)
    return output_dir


def model_yaml(cfg, *, source, output_dir: Path, tokenizer: Path | None) -> str:
    """The text of O/model.yml: the architecture keys of `cfg`, its dtypes and layer layout, the MoE
    capacity and the copied tokenizer, each group with a comment saying where it came from."""
    import yaml

    arch = [*ARCHITECTURE_KEYS, *(MOE_ARCHITECTURE_KEYS if cfg.num_experts > 1 else ())]

    def dump(keys):
        return yaml.safe_dump({k: getattr(cfg, k) for k in keys}, sort_keys=False).rstrip()

    lines = [
        f"# Model config derived from {resolve(source) / 'config.json'}",
        "# by `python -m trainer.convert hf-to-trainer`. Train or decode from the converted weights with",
        f"#   model={output_dir / 'model.yml'} load_parameters_path={output_dir}",
        dump(arch),
        "# dtype: activations (from config.json); weight_dtype: the params as stored in this checkpoint;",
        "# scan_layers: the layer layout the params are stored in (stacked or not): keep it.",
        dump(["dtype", "weight_dtype", "scan_layers"]),
    ]
    if cfg.num_experts > 1:
        lines += [
            "# Dropless, as in Hugging Face (experts / top_k): the first losses match HF exactly. Lower",
            "# it to save memory and time; routed tokens past an expert's capacity are then dropped.",
            dump(["moe_capacity_factor"]),
        ]
    if tokenizer is not None:
        lines += [
            "# The checkpoint's own tokenizer (copied from the source directory).",
            yaml.safe_dump(
                {"tokenizer_path": str(tokenizer), "tokenizer_type": "huggingface"}, sort_keys=False
            ).rstrip(),
        ]
    return "\n".join(lines) + "\n"
