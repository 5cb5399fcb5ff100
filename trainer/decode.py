"""CLI: `python -m trainer.decode [CONFIG] [key=value ...]`: continue a prompt with a trained model.

    python -m trainer.decode base.yml model=O/model.yml load_parameters_path=O prompt="Hello" max_decode_length=32
    python -m trainer.decode base.yml model=qwen3-tiny load_parameters_path=runs/NAME/checkpoints/100 \\
        prompt_ids=[5,17,42] temperature=0.8 top_k=50 top_p=0.95 decode_seed=1

The model comes from the config exactly as for training; the params from load_parameters_path (a
training checkpoint step dir, or a params-only checkpoint such as an hf-to-trainer output). A text
`prompt` is encoded with tokenizer_path / tokenizer_type (BOS first if add_bos) and generation stops
at the tokenizer's EOS; `prompt_ids` are used as given, with no tokenizer and no EOS stop.
Decoding uses the KV cache of `trainer.model.generation` (prefill, then one compiled step per token);
temperature=0 is greedy. Output: the generated text (text prompts only), then one line
`output_ids: [...]` with the new token ids (up to and including EOS). Exit codes: 0 done, 2 bad
config or input, found before any compute and printed as one line `python -m trainer.decode: error:
...` (a load_parameters_path that is missing, a run directory, or does not match `model`, included;
relative paths are taken from the working directory), 1 any other failure (with its traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from trainer.errors import EXIT_OK, tool_main

PROG = "python -m trainer.decode"


def _parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default="base.yml", help="config file path or name in configs/")
    p.add_argument("overrides", nargs="*", help="key=value overrides (values parsed as YAML scalars)")
    args = p.parse_args(argv)
    if "=" in args.config:  # no config file given
        args.overrides.insert(0, args.config)
        args.config = "base.yml"
    return args


def _request(cfg):
    """(prompt ids, tokenizer or None, Sampling) from the config; ConfigError/DataError if unusable."""
    from trainer.config import ConfigError
    from trainer.data.tokenizer import Tokenizer
    from trainer.model.generation import Sampling

    d = cfg.decode
    if not cfg.checkpoint.load_parameters_path:
        raise ConfigError("decoding needs load_parameters_path=<checkpoint step dir or params-only checkpoint>")
    if bool(d.prompt) == bool(d.prompt_ids):
        raise ConfigError('give exactly one of prompt="text" and prompt_ids=[id, ...]')
    try:
        sampling = Sampling(temperature=d.temperature, top_k=d.top_k, top_p=d.top_p)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    tokenizer = None
    if d.prompt:
        tokenizer = Tokenizer(cfg.data.tokenizer_path, cfg.data.tokenizer_type)
        ids = tokenizer.encode(d.prompt)
        if cfg.data.add_bos and tokenizer.bos_id is not None:
            ids = [tokenizer.bos_id, *ids]
    else:
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in d.prompt_ids):
            raise ConfigError(f"prompt_ids must be a list of integers, got {d.prompt_ids!r}")
        ids = list(d.prompt_ids)
    vocab = cfg.model.vocab_size
    if not ids or min(ids) < 0 or max(ids) >= vocab:
        raise ConfigError(f"prompt token ids must be non-empty and in [0, {vocab}) (vocab_size), got {ids}")
    return ids, tokenizer, sampling


def _load_params(cfg):
    import jax

    from trainer.checkpoint import load_parameters
    from trainer.model import abstract_params

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), abstract_params(cfg.model)
    )
    return load_parameters(cfg.checkpoint.load_parameters_path, target)


def decode(cfg) -> tuple[list[int], str | None]:
    """New token ids (cut after the first EOS) and, for text prompts, their text."""
    from trainer.model.generation import generate

    ids, tokenizer, sampling = _request(cfg)
    eos = tokenizer.eos_id if tokenizer is not None else None
    out = generate(
        _load_params(cfg),
        cfg.model,
        ids,
        cfg.decode.max_decode_length,
        sampling,
        seed=cfg.decode.decode_seed,
        eos_id=eos,
    )[0].tolist()
    if eos is not None and eos in out:
        out = out[: out.index(eos) + 1]
    text = None if tokenizer is None else tokenizer.decode([i for i in out if i != eos])
    return out, text


def main(argv=None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s] %(message)s", stream=sys.stderr)
    return tool_main(PROG, lambda: _run(args))


def _run(args) -> int:
    from trainer.config import load_config

    cfg = _resolve_paths(load_config(args.config, args.overrides))
    _request(cfg)  # every input problem before any compute
    _check_checkpoint(cfg)
    out, text = decode(cfg)
    if text is not None:
        print(text)
    print(f"output_ids: {out}", flush=True)
    return EXIT_OK


def _resolve_paths(cfg):
    """load_parameters_path made absolute (cwd-relative, ~ expanded): Orbax refuses relative paths."""
    from trainer.io.paths import resolve

    path = cfg.checkpoint.load_parameters_path
    if not path:
        return cfg
    checkpoint = dataclasses.replace(cfg.checkpoint, load_parameters_path=str(resolve(path)))
    return dataclasses.replace(cfg, checkpoint=checkpoint)


def _check_checkpoint(cfg) -> None:
    """load_parameters_path is a committed checkpoint whose params have the shapes `model` builds: said
    in one line naming the path (or the first differing tensor) instead of an Orbax traceback."""
    from trainer.checkpoint.checks import check_checkpoint_dir, check_params_match

    path = check_checkpoint_dir(cfg.checkpoint.load_parameters_path, flag="load_parameters_path")
    check_params_match(
        path,
        cfg.model,
        flag="load_parameters_path",
        fix="model= must be the model the checkpoint was trained with (for an hf-to-trainer "
        "output: model=<its directory>/model.yml)",
    )


if __name__ == "__main__":
    sys.exit(main())
