"""The typed config schema: the single source of every key's default, type and documentation.

Each concern has one frozen dataclass; `RunConfig` composes them. On the command line and in YAML
the keys are flat (`learning_rate=1e-3`, MaxText's names where the concept is the same); the loader
maps each flat key to exactly one field here, so a default is written once, in this file.
`configs/base.yml` is generated from this file (`python -m trainer.config.render_base`) and a test
checks they agree.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.failures.plan import FaultPlan

AUTO = -1  # a period key set to `auto`: the trainer plans it (trainer.elastic.periods.AutoPeriods)
# checkpoint_period=auto where nobody plans it (elastic off, several processes, tools): the default period.
UNPLANNED_CHECKPOINT_PERIOD = 10_000


def key(
    default: Any,
    doc: str,
    *,
    choices: tuple | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    auto: bool = False,
    number: bool = False,
    above: float | None = None,
):
    """A config field: its default, one-line documentation and optional constraints (inclusive bounds;
    `above`: an exclusive lower bound).
    `auto`: an integer key that also takes `auto` (stored as AUTO, -1).
    `number`: a key that takes a whole number (kept an int) or a decimal fraction (`trainer.config.values`)."""
    meta = {
        "doc": doc,
        "choices": choices,
        "minimum": minimum,
        "maximum": maximum,
        "auto": auto,
        "number": number,
        "above": above,
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: _copy(default), metadata=meta)
    return field(default=default, metadata=meta)


def _copy(value):
    import copy

    return copy.deepcopy(value)


DTYPES = ("float32", "bfloat16", "float16")

# Logical-axis -> mesh-axes rules. Params and activations are annotated with the logical names on
# the left; each maps to the mesh axes on the right (in order, as many as divide the dimension).
# The vocabulary takes fsdp too: the embedding table is stored split by rows, and the loss splits
# the vocabulary over the devices (trainer/program/step.py), so the table never moves.
DEFAULT_LOGICAL_AXIS_RULES = [
    ["activation_batch", ["data", "fsdp", "expert"]],
    ["activation_length", ["context"]],
    ["activation_embed", []],
    ["activation_heads", ["tensor"]],
    ["activation_kv_heads", ["tensor"]],
    ["activation_mlp", ["tensor"]],
    ["activation_vocab", ["tensor", "fsdp"]],
    ["activation_exp", ["expert"]],
    ["vocab", ["tensor", "fsdp"]],
    ["embed", ["fsdp", "context"]],
    ["heads", ["tensor"]],
    ["kv_heads", ["tensor"]],
    ["head_dim", []],
    ["mlp", ["tensor"]],
    ["exp", ["expert"]],
    ["layers", []],
    ["norm", []],
]

# The ModelConfig keys that choose a family's code and its RoPE variant: this trainer's own names (MaxText
# has neither key).
FAMILY_KEYS = ("model_family", "rope_scaling")
# The ModelConfig keys that fix a dense model's architecture (a checkpoint's shapes and its numerics): the
# family keys, then the rest by the names MaxText gives them; an MoE model adds MOE_ARCHITECTURE_KEYS.
ARCHITECTURE_KEYS = (
    *FAMILY_KEYS,
    "base_num_decoder_layers",
    "base_emb_dim",
    "base_num_query_heads",
    "base_num_kv_heads",
    "head_dim",
    "base_mlp_dim",
    "vocab_size",
    "rope_max_timescale",
    "normalization_layer_epsilon",
    "use_qk_norm",
    "logits_via_embedding",
)
MOE_ARCHITECTURE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "base_moe_mlp_dim",
    "norm_topk_prob",
    "load_balance_loss_weight",
)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the decoder (dense or MoE), its model family and its numerics.

    `model_family` names the family whose decoder, Hugging Face mapping and FLOPs read the other keys
    (trainer/model/<family>/)."""

    model: str = key("qwen3-tiny", "Model preset: loads configs/models/<model>.yml before CLI overrides.")
    model_family: str = key(
        "qwen3",
        "Model family (trainer/model/<family>/: its decoder, Hugging Face mapping, FLOPs): qwen3 | llama3. "
        "Each preset sets it.",
        choices=("qwen3", "llama3"),
    )
    base_num_decoder_layers: int = key(4, "Number of transformer blocks.", minimum=1)
    base_emb_dim: int = key(256, "Hidden size (d_model).", minimum=1)
    base_num_query_heads: int = key(4, "Attention query heads.", minimum=1)
    base_num_kv_heads: int = key(2, "Attention key/value heads (GQA); must divide the query heads.", minimum=1)
    head_dim: int = key(64, "Dimension of each attention head (need not be emb_dim / heads).", minimum=1)
    base_mlp_dim: int = key(768, "SwiGLU hidden size of the dense MLP.", minimum=1)
    vocab_size: int = key(
        32768, "Vocabulary size (rows of the embedding table), below 2^24.", minimum=1, maximum=2**24 - 1
    )
    rope_max_timescale: float = key(1_000_000.0, "RoPE theta.", minimum=1.0)
    rope_scaling: str = key(
        "none",
        "RoPE frequency scaling, as its type and parameters: none | linear:factor=F | dynamic:factor=F,"
        "original_max_position_embeddings=N | yarn:factor=F,original_max_position_embeddings=N,beta_fast=B,"
        "beta_slow=B[,attention_factor=A,mscale=M,mscale_all_dim=M,truncate=false] | llama3:factor=F,"
        "low_freq_factor=L,high_freq_factor=H,original_max_position_embeddings=N (docs/models.md#rope-scaling).",
    )
    normalization_layer_epsilon: float = key(1e-6, "RMSNorm epsilon.", minimum=0.0)
    use_qk_norm: bool = key(True, "Per-head RMSNorm on queries and keys before RoPE (Qwen3; Llama has none).")
    logits_via_embedding: bool = key(True, "Tie the output projection to the input embedding.")
    num_experts: int = key(1, "Experts per MoE layer; 1 means a dense MLP.", minimum=1)
    num_experts_per_tok: int = key(1, "Experts each token is routed to (top-k).", minimum=1)
    base_moe_mlp_dim: int = key(0, "SwiGLU hidden size of each expert (MoE only).", minimum=0)
    norm_topk_prob: bool = key(True, "Renormalise the top-k router probabilities to sum to 1 (MoE).")
    load_balance_loss_weight: float = key(
        0.0, "Coefficient of the MoE load-balancing auxiliary loss.", minimum=0.0
    )
    moe_capacity_factor: float = key(
        1.25,
        "Expert capacity per batch row = factor * row tokens * top_k / experts; overflow tokens are "
        "dropped (factor >= experts / top_k never drops).",
        minimum=0.0,
    )
    dtype: str = key("bfloat16", "Activation and matmul dtype.", choices=DTYPES)
    weight_dtype: str = key("float32", "Parameter (and optimizer state) dtype.", choices=DTYPES)
    scan_layers: bool = key(True, "Stack the blocks and run them with a scan (faster compile).")
    remat_policy: str = key(
        "full",
        "Activation rematerialisation: none | full | minimal (save matmul outputs).",
        choices=("none", "full", "minimal"),
    )
    attention: str = key(
        "autoselected",
        "Attention kernel: dot_product (einsum, memory ~ T^2) | flash (blockwise JAX, memory ~ T, any "
        "backend) | cudnn_flash (GPU) | splash (TPU) | autoselected (best for the backend, logged).",
        choices=("autoselected", "dot_product", "flash", "cudnn_flash", "splash"),
    )
    sa_block_q: int = key(
        512, "Query tile of attention=flash/splash (clipped to the sequence; splash: x128).", minimum=1
    )
    sa_block_kv: int = key(
        512, "Key/value tile of attention=flash/splash (clipped to the sequence; splash: x128).", minimum=1
    )


@dataclass(frozen=True)
class MeshConfig:
    """How the devices of the active slices form the mesh."""

    num_slices: int = key(1, "Slices (on CPU/GPU: virtual slices grouping the local devices).", minimum=1)
    ici_data_parallelism: int = key(1, "Data parallelism inside a slice; -1 = fill.")
    ici_fsdp_parallelism: int = key(-1, "Fully-sharded data parallelism inside a slice; -1 = fill.")
    ici_tensor_parallelism: int = key(1, "Tensor (Megatron) parallelism inside a slice; -1 = fill.")
    ici_expert_parallelism: int = key(1, "Expert parallelism inside a slice (MoE); -1 = fill.")
    ici_context_parallelism: int = key(
        1,
        "Context parallelism inside a slice: every activation's sequence split this many ways, causally "
        "load-balanced (max_target_length a multiple of 2x it; attention=dot_product or flash).",
        minimum=1,
    )
    context_parallel_strategy: str = key(
        "all_gather",
        "How attention sees the other shards' keys and values under context parallelism: all_gather "
        "(gather them once per layer) | ring (pass them around the context axis block by block, the "
        "exchange overlapping the compute).",
        choices=("all_gather", "ring"),
    )
    logical_axis_rules: list = key(
        DEFAULT_LOGICAL_AXIS_RULES, "Logical-axis -> mesh-axes rules for params and activations."
    )
    enable_single_controller: bool = key(False, "Run under Pathways (TPU): one controller sees every slice.")


@dataclass(frozen=True)
class DataConfig:
    """Where batches come from and their shape."""

    dataset_type: str = key(
        "synthetic",
        "synthetic (generated, learnable) | arrayrecord (Grain).",
        choices=("synthetic", "arrayrecord"),
    )
    per_device_batch_size: int | float = key(
        2,
        "Sequences per device per micro-step; a fraction such as 0.5 shares a sequence between devices "
        "(x devices per slice must be whole sequences, e.g. 1/ici_context_parallelism).",
        number=True,
        above=0,
    )
    max_target_length: int = key(2048, "Sequence length in tokens.", minimum=2)
    data_shuffle_seed: int = key(0, "Seed of the data order (shuffle, synthetic stream).")
    grain_train_files: str = key(
        "",
        "arrayrecord: glob(s) of ArrayRecord shards, comma-separated "
        "(e.g. data/fc_sample/*.arrayrecord; relative to cwd, else the repo; ~; gs://); a weighted "
        "mixture as 'pattern_a,0.7;pattern_b,0.3' (relative weights >= 0).",
    )
    tokenizer_path: str = key(
        "data/tokenizer/fc_sp8k.model",
        "arrayrecord: sentencepiece .model or HF tokenizer.json (relative to cwd, else the repo; ~; gs://).",
    )
    data_cache_dir: str = key(
        "",
        "arrayrecord: where shards on an object store are copied once per host before "
        "reading (tokenizers go to $TRAINER_CACHE_DIR/remote); '' = the same "
        "(~/.cache/elastic-trainer/remote).",
    )
    tokenizer_type: str = key(
        "sentencepiece",
        "arrayrecord: sentencepiece | huggingface (tokenizer.json).",
        choices=("sentencepiece", "huggingface"),
    )
    packing: bool = key(True, "arrayrecord: pack several whole documents per row (else one per row, padded).")
    use_sft: bool = key(
        False, "arrayrecord: chat records, Qwen chat template, loss on assistant tokens only (= objective=sft)."
    )
    objective: str = key(
        "pretrain",
        "What trains: pretrain (every token) | sft (arrayrecord chats, loss on assistant tokens; use_sft=true "
        "means the same) | dpo (arrayrecord preference pairs, direct preference optimization against the "
        "frozen initial model: batch sizes count pairs, each pair is two rows, prompt+chosen and "
        "prompt+rejected, masked on the reply).",
        choices=("pretrain", "sft", "dpo"),
    )
    num_epoch: int = key(-1, "arrayrecord: passes over the data; <= 0 repeats forever (steps bounds training).")
    grain_worker_count: int = key(
        1, "arrayrecord: Grain worker processes (0 = load in the training process).", minimum=0
    )
    grain_per_worker_buffer_size: int = key(2, "arrayrecord: global steps each worker prefetches.", minimum=1)
    add_bos: bool = key(False, "arrayrecord: prepend the tokenizer's BOS to every document.")
    add_eos: bool = key(True, "arrayrecord: append EOS (<|endoftext|>) to every document, a trained target.")
    text_field: str = key("text", "arrayrecord: JSON field of a record holding plain text.")
    messages_field: str = key(
        "messages", "arrayrecord: JSON field of a record holding a chat (role/content list)."
    )

    @property
    def sft(self) -> bool:
        """Whether the loss is on assistant tokens only: objective=sft, or use_sft=true (the same)."""
        return self.use_sft or self.objective == "sft"

    @property
    def dpo(self) -> bool:
        """Whether batches are preference pairs (objective=dpo)."""
        return self.objective == "dpo"


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, its schedule, clipping and accumulation."""

    learning_rate: float = key(3e-4, "Peak learning rate.", minimum=0.0)
    warmup_steps_fraction: float = key(
        0.1, "Fraction of the schedule spent in linear warmup.", minimum=0.0, maximum=1.0
    )
    cosine_learning_rate_final_fraction: float = key(
        0.1, "Final LR as a fraction of the peak.", minimum=0.0, maximum=1.0
    )
    learning_rate_schedule_steps: int = key(-1, "Length of the LR schedule; -1 = steps.", minimum=-1)
    adam_b1: float = key(0.9, "AdamW beta1.", minimum=0.0)
    adam_b2: float = key(0.95, "AdamW beta2.", minimum=0.0)
    adam_eps: float = key(1e-8, "AdamW epsilon.", minimum=0.0)
    adam_weight_decay: float = key(0.1, "AdamW decoupled weight decay.", minimum=0.0)
    gradient_clipping_threshold: float = key(1.0, "Global-norm gradient clipping; 0 disables.", minimum=0.0)
    gradient_accumulation_steps: int = key(1, "Micro-steps accumulated per optimizer step.", minimum=1)
    z_loss_multiplier: float = key(0.0, "Weight of the z-loss (log(Z)^2) regulariser.", minimum=0.0)
    data_reduce_dtype: str = key(
        "bfloat16",
        "Dtype in which the gradients of the data-parallel replicas (slices) are summed, once per step: the "
        "only traffic across slices (the DCN). bfloat16 halves it; float32 sums exactly in float32.",
        choices=("bfloat16", "float32"),
    )


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA) over a frozen base model: a parameterisation of whatever objective trains.

    With lora_rank > 0 the train state's params are the adapters only; the base (load_parameters_path,
    else initialised from init_weights_seed) is frozen in weight_dtype, outside the state."""

    lora_rank: int = key(
        0,
        "LoRA rank r; 0 = full training. > 0 trains adapters A [in, r], B [r, out] on the targeted projections "
        "(W + lora_alpha / r * A B) over the frozen base: checkpoints hold the adapters and their optimizer "
        "state only.",
        minimum=0,
    )
    lora_alpha: float = key(
        16.0, "LoRA scaling numerator: the adapters' update is scaled by lora_alpha / lora_rank."
    )
    lora_dropout: float = key(
        0.0, "Dropout on the adapters' input; only 0 is supported (the step stays deterministic).", minimum=0.0
    )
    lora_target_modules: list = key(
        list(LORA_MODULES),
        "Projections that get adapters, by their PEFT names: q_proj k_proj v_proj o_proj (attention), gate_proj "
        "up_proj down_proj (dense MLP); or [all-linear] for all of them.",
    )


@dataclass(frozen=True)
class PreferenceConfig:
    """Direct preference optimization (objective=dpo): the loss over each pair's policy/reference log-ratio.

    The reference is the frozen initial model (load_parameters_path, else init_weights_seed; under LoRA the
    base without adapters), identified in checkpoints like a LoRA base."""

    dpo_beta: float = key(
        0.1, "objective=dpo: beta, the strength of the implicit KL penalty towards the reference.", minimum=0.0
    )
    dpo_loss_type: str = key(
        "sigmoid",
        "objective=dpo: sigmoid (DPO) | ipo (squared, on per-token average log-probs) | hinge (SLiC), as TRL "
        "defines them.",
        choices=("sigmoid", "ipo", "hinge"),
    )
    dpo_label_smoothing: float = key(
        0.0,
        "objective=dpo, dpo_loss_type=sigmoid: probability that a pair's labels are flipped (conservative DPO).",
        minimum=0.0,
        maximum=0.5,
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under <run dir>/checkpoints."""

    enable_checkpointing: bool = key(True, "Save checkpoints.")
    checkpoint_period: int = key(
        AUTO,
        "Save every this many steps (and at the final step). auto (-1): with elastic_enabled, planned from the "
        "run's measured step and save costs and the failure rate, like snapshot_period (a save in the warm-up "
        "measures its cost; event periods_planned); without elastic_enabled, or with several processes, "
        f"{UNPLANNED_CHECKPOINT_PERIOD}.",
        minimum=-1,
        auto=True,
    )
    async_checkpointing: bool = key(True, "Write checkpoints in the background while training continues.")
    max_num_checkpoints_to_keep: int = key(
        3,
        "Committed checkpoints kept (oldest deleted first); <= 0 keeps all. Keep >= 2 so a corrupt "
        "newest checkpoint can fall back to the previous one.",
    )
    enable_continuous_checkpointing: bool = key(
        False, "Start the next save as soon as the previous one has finished, ignoring checkpoint_period."
    )
    checkpoint_compression: bool = key(
        True,
        "zstd-compress checkpoint arrays (Orbax's default): smaller files for more host CPU per save. "
        "false: larger files for less CPU per save (where host cores are scarce, e.g. CPU training).",
    )
    local_checkpoint_directory: str = key(
        "",
        "Node-local directory (local SSD, RAM disk) for the local checkpoint tier: frequent checkpoints "
        "that survive the process, not the node. The run's steps go under <dir>/<run name>. '' = off.",
    )
    local_checkpoint_period: int = key(
        0,
        "Write the host snapshot to local_checkpoint_directory every this many steps (0 = off; auto or -1 "
        "= planned from measured costs, as snapshot_period). A start or retry restores the newest of host "
        "snapshot, local and persistent checkpoint.",
        minimum=-1,
        auto=True,
    )
    max_num_local_checkpoints_to_keep: int = key(
        2, "Committed local checkpoints kept (oldest deleted first): bounds the local disk use.", minimum=1
    )
    local_checkpoint_wait_for_write: bool = key(
        False,
        "true: the step after a local save waits until its write is committed, so a lost process never "
        "trains more than local_checkpoint_period steps again. false: the write may overlap the following "
        "steps (free where host cores are idle, as on GPU/TPU hosts, where it ends within a step anyway); "
        "a process lost mid-write then loses the period plus the steps the write took.",
    )
    load_parameters_path: str = key(
        "",
        "If the run has no checkpoint yet: start from these params only (a checkpoint step dir or a "
        "params-only checkpoint), with a fresh optimizer.",
    )
    load_full_state_path: str = key(
        "",
        "If the run has no checkpoint yet: start from this checkpoint step dir's full train state "
        "(params, optimizer state, step).",
    )


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: loss on an eval set the run never trains on, at a fixed step interval."""

    eval_interval: int = key(-1, "Evaluate every this many steps (and at the last step); -1 = off.", minimum=-1)
    eval_steps: int = key(
        -1,
        "Eval batches per evaluation; -1 = one whole pass over grain_eval_files (arrayrecord). The "
        "synthetic held-out stream is endless: set >= 1.",
        minimum=-1,
    )
    eval_start_step: int = key(0, "No evaluation before this step (the last step always evaluates).", minimum=0)
    grain_eval_files: str = key(
        "",
        "arrayrecord: glob(s) of the held-out ArrayRecord shards (same format, tokenizer and SFT "
        "settings as grain_train_files); required when eval_interval > 0.",
    )
    eval_per_device_batch_size: int | float = key(
        0,
        "Eval sequences per device of all configured slices (a fraction as per_device_batch_size); "
        "0 = per_device_batch_size.",
        minimum=0,
        number=True,
    )
    target_eval_loss: float = key(
        0.0,
        "Stop early (checkpoint, exit 0) once an eval loss is <= this; 0 = off. Needs eval_interval > 0.",
        minimum=0.0,
    )


@dataclass(frozen=True)
class ElasticConfig:
    """In-process recovery from slice failures."""

    elastic_enabled: bool = key(False, "Retry the train function in-process after a slice failure.")
    elastic_timeout_seconds: float = key(300.0, "How long to wait for enough slices after a failure.", minimum=0.0)
    elastic_max_retries: int = key(
        10,
        "Give up (exit 3) when more than this many slice failures land within elastic_retry_window_steps steps "
        "of the run's progress: failures faster than progress. Failures spread over a run never end it.",
        minimum=0,
    )
    elastic_retry_window_steps: int = key(
        50,
        "The window of elastic_max_retries: failures count while the run has made fewer than this many steps "
        "of net progress (its furthest step) since them.",
        minimum=1,
    )
    elastic_min_slice_count: int = key(
        -1, "Slices needed to continue: -1 = all (pause-and-resume); 1..num_slices-1 = replica-resize."
    )
    elastic_resize_batch_policy: str = key(
        "keep_global",
        "On fewer slices: keep_global (same global batch via more micro-steps: same math) | "
        "scale (global batch and learning rate scale with the active slices).",
        choices=("keep_global", "scale"),
    )
    elastic_resize_bitwise: bool = key(
        False,
        "Replica-resize keeps the bits: the global batch is summed as fixed groups of rows in one order on any "
        "number of slices, so a run that shrinks or grows trains the same bits as one that never did. Each "
        "step all-gathers every replica's group gradients across slices instead of all-reducing one sum "
        "(more DCN bytes and one gradient copy per replica in memory). Needs keep_global.",
    )
    elastic_poll_interval_seconds: float = key(
        1.0, "Seconds between slice-health checks while waiting for slices and for scale-up.", minimum=0.0
    )
    snapshot_period: int = key(
        AUTO,
        "Copy train + data state to the devices' hosts' memory every this many steps (async); 0 disables. "
        "auto (-1): with elastic_enabled, planned from the run's measured step and snapshot costs and the "
        "failure rate (trainer.plan's model; event periods_planned), re-planned as they change; without "
        "elastic_enabled, off.",
        minimum=-1,
        auto=True,
    )
    expected_mtbf_per_chip_hours: float = key(
        50_000.0,
        "Failure rate the auto periods plan for until the run has failures of its own (then its observed "
        "rate): mean hours between failures of one chip; a slice fails that many hours / its chips. Default "
        "from Llama 3's 54-day pretraining: 419 unexpected interruptions on 16,384 GPUs (~50,700 GPU-hours "
        "each).",
        minimum=1e-6,
    )
    expected_process_kill_share: float = key(
        0.1,
        "auto checkpoint_period: the share of failures assumed to take the trainer process down (its host or "
        "the controller) rather than a slice it recovers from in the process; those restart from the local or "
        "persistent tier, so they set how often the persistent tier saves.",
        minimum=0.0,
        maximum=1.0,
    )
    auto_snapshot_max_overhead: float = key(
        0.1,
        "auto snapshot_period: snapshot at least this often as long as the snapshots cost at most this share "
        "of step time (measured), even where rare failures make longer periods optimal in expectation: a "
        "failure then rewinds few steps. 0 = the planner's period alone.",
        minimum=0.0,
        maximum=1.0,
    )
    sdc_check_period: int = key(
        AUTO,
        "Silent-data-corruption check: every this many steps, before the step runs, the replicas' copies of "
        "the parameters are compared and the step is computed again with each slice on another slice's rows, "
        "bit for bit; a mismatch (event sdc_detected, naming the slice) restores the newest state verified "
        "clean. Costs about 2/period of a step. auto (-1): on 2+ slices of one controller, planned from the "
        "measured step and check times (event sdc_period_planned): the planner's best period for "
        "expected_sdc_mtbf_per_chip_hours, but at least as often as the checks cost at most "
        "auto_sdc_max_overhead of step time; one slice or several processes: off. 0 = off.",
        minimum=-1,
        auto=True,
    )
    auto_sdc_max_overhead: float = key(
        0.02,
        "auto sdc_check_period: check at least this often as long as the checks cost at most this share of "
        "step time (measured). 0 = the planner's period alone.",
        minimum=0.0,
        maximum=1.0,
    )
    expected_sdc_mtbf_per_chip_hours: float = key(
        3.5e6,
        "auto sdc_check_period: mean hours until one chip computes wrong numbers. Default from Llama 3's 54-day "
        "pretraining: 6 of its 419 unexpected interruptions were silent data corruption, on 16,384 GPUs "
        "(~3.5 million GPU-hours each).",
        minimum=1.0,
    )
    sdc_quarantine: bool = key(
        False,
        "After an sdc_detected that names one slice, treat that slice as lost (replica-resize onto the others: "
        "set elastic_min_slice_count below num_slices).",
    )
    fault_schedule: str = key(
        "",
        "Injected failures (local slices): 'step=40,slice=1,down_s=5; step=90,slice=2,down_steps=10; "
        "step=120,nan=1; rate=0.5,seed=1' (down_steps: back after that many more steps; nan: a non-finite "
        "step; rate: Poisson failures per second of wall time from step 1 (or step=N), seeded, on a random "
        "slice unless slice=K); 'step=N,hang_s=S': step N's dispatch blocks S seconds (once per run); "
        "'step=N,spike=F': step N's loss and update are multiplied by F (once per run); "
        "'step=N,slice=K,corrupt=1': slice K's devices compute on wrong numbers in step N (once per run; "
        "corrupt=persistent: in every step from N on, a bad chip); 'step=N,slice=K,flip=1': a bit of slice K's "
        "copy of the parameters flips after step N (once per run). With several processes only "
        "'step=N,process=P,error=oom|bug': that process's own error, which ends every process with its cause. "
        "Either way 'storage=restore|save[,count=N]': the "
        "first N checkpoint reads / saves fail as a transient storage error would.",
    )


@dataclass(frozen=True)
class ObserveConfig:
    """Metrics, logs and TensorBoard."""

    log_period: int = key(10, "Print a metrics line every this many steps.", minimum=1)
    log_format: str = key(
        "text",
        "How the console shows logs and events: text (sentences for people; at a terminal a progress line "
        "redrawn below them) | kv (grep-friendly 'event=NAME key=value' lines) | json (one JSON object per "
        "line with severity, message, the event's fields and the run's identity; INFO on stdout, WARNING and "
        "above on stderr: for Cloud Logging and other collectors). events.jsonl is the same in all three.",
        choices=("text", "kv", "json"),
    )
    enable_tensorboard: bool = key(True, "Write TensorBoard scalars to the run directory.")
    peak_tflops_per_device: float = key(
        0.0, "Peak TFLOP/s of one device for MFU; 0 = look up the device kind (null MFU if unknown).", minimum=0.0
    )
    nan_policy: str = key(
        "stop",
        "Non-finite loss or gradients (the update is never applied): stop (error, exit 1) | "
        "skip_step (continue, counted) | rollback (restore newest snapshot/checkpoint, skip the batch).",
        choices=("stop", "skip_step", "rollback"),
    )
    loss_spike_threshold: float = key(
        3.0,
        "Loss-spike rollback: a step whose loss exceeds this many times the median of the previous "
        "loss_spike_window losses is undone: the run restores the newest saved state before it and never "
        "trains the batches from there through the spike (event loss_spike_rollback; also after a restart). "
        "0 = off; else > 1. Default 3: twice the largest loss / median of clean runs on real text and SFT "
        "(1.46, none over 2 in 700 steps; benchmarks/spike_false_positives.py), far below a gross spike. "
        "While on, a step's loss is read before any save of that step: the step after a save is dispatched "
        "once that step finished (costing at most the host's per-step time, per save).",
        minimum=0.0,
    )
    loss_spike_window: int = key(
        32,
        "Losses in the running median that loss_spike_threshold compares with; a step is judged once 4 "
        "(or the window, if fewer) are known, on the median of those it has.",
        minimum=2,
    )
    loss_spike_max_rollbacks: int = key(
        3,
        "Loss-spike rollbacks allowed within loss_spike_rollback_window steps; one more stops the run (exit 3).",
        minimum=1,
    )
    loss_spike_rollback_window: int = key(
        1000, "The span, in steps, over which loss_spike_max_rollbacks counts rollbacks.", minimum=1
    )
    profiler: str = key(
        "",
        "'' (off) | xplane: a JAX profiler trace (TensorBoard/XProf) under <run dir>/profile.",
        choices=("", "xplane"),
    )
    skip_first_n_steps_for_profiler: int = key(
        3, "Steps to run before the trace starts (compile, warm-up).", minimum=0
    )
    profiler_steps: int = key(5, "Steps to trace.", minimum=1)
    monitor_step_time_deviation: float = key(
        0.0,
        "Emit a slow_step event (events.jsonl, trainer.report) when a step takes more than this many times "
        "the median of the previous 20 step times (after 5 steps of the attempt); 0 = off. Several processes: "
        "the event names the slowest one.",
        minimum=0.0,
    )
    enable_wandb: bool = key(
        False,
        "Log the TensorBoard scalars and the run's events to Weights & Biases (pip install "
        "'elastic-trainer[wandb]'); restarts continue the same W&B run. WANDB_MODE=offline: files only.",
    )
    wandb_project: str = key("elastic-trainer", "W&B project of the run (enable_wandb).")
    wandb_run_name: str = key("", "W&B display name of the run (enable_wandb); '' = the run directory's name.")
    metrics_port: int = key(
        0,
        "Serve live metrics for Prometheus (step, loss, goodput and badput by cause, recoveries, ...) on "
        "this port of process 0, all interfaces, path /metrics (docs/live_metrics.md), and the control "
        "endpoint beside them (checkpoint, drain, replan; python -m trainer.control); 0 = off.",
        minimum=0,
        maximum=65535,
    )


@dataclass(frozen=True)
class TrainConfig:
    """The run itself: identity, length, output location, seed."""

    run_name: str = key(
        "",
        "Run name; the run directory is <base_output_directory>/<run_name>. Empty = the "
        "job's name ($JOBSET_NAME, $SLURM_JOB_NAME-$SLURM_JOB_ID), else <model>-<data>: the "
        "same command resumes the same run.",
    )
    base_output_directory: str = key(
        "runs", "Parent directory of run directories: relative (to the working directory), absolute, ~ or gs://."
    )
    steps: int = key(100, "Optimizer steps to train.", minimum=1)
    init_weights_seed: int = key(0, "Seed of parameter initialisation.")
    run_lease_stale_seconds: float = key(
        120.0,
        "One job per run directory: process 0 holds a lease (<run dir>/lease/) with a heartbeat; another job "
        "exits 2 while it is live. A lease whose heartbeat stopped this long ago is taken over (a restart of "
        "the same job, or a host's dead process, takes it at once); 0 = no lease.",
        minimum=0.0,
    )
    stop_timeout_seconds: float = key(
        20.0,
        "After SIGTERM (drain, preemption, time limit) the process exits within this bound with code 42, "
        "having saved the newest state it holds when time allows (local tier first). Set the scheduler's "
        "grace period (terminationGracePeriodSeconds, Slurm --signal) above it.",
        minimum=1.0,
    )
    hang_timeout_seconds: int = key(
        AUTO,
        "Progress watchdog: when no step completes for this long, the process dumps every thread's stack, "
        "emits hang_detected, writes its newest host snapshot to the local tier, and exits 75 (transient: "
        "the scheduler restarts the same command, which resumes). auto (-1): 10x the median step time, at "
        "least 300 s; 0 = no watchdog.",
        minimum=-1,
        auto=True,
    )
    hang_timeout_phase_seconds: int = key(
        1800,
        "The progress watchdog's bound (hang_timeout_seconds != 0) for everything but steps: start-up, "
        "compile, restore, a checkpoint save's blocking part, an evaluation. Waiting for slices is bounded "
        "by elastic_timeout_seconds instead.",
        minimum=1,
    )
    jax_cache_dir: str = key(
        "~/.cache/elastic-trainer/jax",
        "JAX persistent compilation cache (restarts skip compiling); with several processes, processes "
        "other than 0 keep their own executables under <dir>/processes (JAX's cache serves process 0 "
        "only); empty disables both.",
    )


@dataclass(frozen=True)
class DistributedConfig:
    """The backend the job runs on, and multi-process JAX (one process per host, no Pathways): joining the
    job and surviving a dead peer."""

    cluster: str = key(
        "auto",
        "The backend the job runs on: local (one process, its devices grouped into virtual slices) | "
        "pathways (one controller sees every slice; needs pathwaysutils) | processes (several processes "
        "joined by jax.distributed, a slice per processes_per_slice of them) | auto (several processes: "
        "processes; else enable_single_controller: pathways; else local).",
        choices=("auto", "local", "pathways", "processes"),
    )
    coordinator_address: str = key(
        "",
        "host:port of process 0, which hosts the coordination service; '' = $JAX_COORDINATOR_ADDRESS "
        "(unset: one process, no jax.distributed).",
    )
    num_processes: int = key(
        -1, "Processes in the job; -1 = $JAX_NUM_PROCESSES, else $SLURM_NTASKS, else 1.", minimum=-1
    )
    process_id: int = key(
        -1,
        "This process's id (0 hosts the coordination service); -1 = $JAX_PROCESS_ID, "
        "else $SLURM_PROCID, else $JOB_COMPLETION_INDEX.",
        minimum=-1,
    )
    processes_per_slice: int = key(
        -1,
        "Processes per slice (a replica group that fails and returns as a whole); -1 = $NODES_PER_SLICE, "
        "else 1. num_slices must equal num_processes / processes_per_slice.",
        minimum=-1,
    )
    heartbeat_timeout_seconds: int = key(
        0,
        "Seconds without a heartbeat before a process is declared dead (the detection time of a kill); "
        "shorter detects sooner but a stalled host (swap, GC, CPU starvation) is then dropped as dead. "
        "0 = $JAX_HEARTBEAT_TIMEOUT_SECONDS, else 10.",
        minimum=0,
    )
    collective_timeout_seconds: int = key(
        0,
        "Bound on one CPU (gloo) collective: a survivor blocked on a dead peer's data fails after this. "
        "Must exceed any legitimate wait inside a collective (step skew, one process compiling or "
        "checkpointing); a longer value only delays recovery in the rare case a receive hangs. "
        "0 = keep what XLA_FLAGS sets, else 60.",
        minimum=0,
    )


@dataclass(frozen=True)
class DecodeConfig:
    """Text generation (`python -m trainer.decode`): prompt, length and sampling."""

    prompt: str = key("", "Text to continue, encoded with tokenizer_path / tokenizer_type.")
    prompt_ids: list = key([], "Token ids to continue instead of a text prompt, e.g. [1, 2, 3] (no tokenizer).")
    max_decode_length: int = key(64, "Tokens to generate after the prompt (fewer if EOS comes first).", minimum=1)
    temperature: float = key(0.0, "Sampling temperature; 0 = greedy (argmax).", minimum=0.0)
    top_k: int = key(0, "Sample among the top_k most likely tokens only; 0 = no limit.", minimum=0)
    top_p: float = key(
        1.0,
        "Sample among the most likely tokens up to this total probability (0 < p <= 1); 1 = no limit.",
        minimum=0.0,
        maximum=1.0,
    )
    decode_seed: int = key(0, "Seed of sampling: the same seed reproduces a sampled continuation.")


@dataclass(frozen=True)
class RunConfig:
    """The whole resolved config: one sub-config per concern."""

    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    @property
    def frozen_base(self) -> bool:
        """Whether a frozen copy of the initial model runs beside the trainable params: LoRA's base, or
        DPO's reference (`frozen_model`)."""
        return frozen_model(self.lora, self.data)

    @functools.cached_property
    def faults(self) -> FaultPlan:
        """`fault_schedule` parsed into its typed faults (`trainer.failures.plan`): once per config, at
        validation, where a bad entry stops the run; every part of the run reads this plan."""
        from trainer.failures.plan import parse_plan

        return parse_plan(self.elastic.fault_schedule, self.mesh.num_slices)


def frozen_model(lora: LoraConfig, data: DataConfig) -> bool:
    """Whether the run holds a frozen model outside its train state (load_parameters_path, else initialised
    from init_weights_seed, loaded on every start and identified in every checkpoint by
    `trainer.checkpoint.base_identity`): LoRA's base (lora_rank > 0) or DPO's reference (objective=dpo)."""
    return lora.lora_rank > 0 or data.dpo


def section_classes() -> dict[str, type]:
    """Section name -> dataclass, in RunConfig order."""
    hints = {
        "train": TrainConfig,
        "model": ModelConfig,
        "mesh": MeshConfig,
        "data": DataConfig,
        "optim": OptimConfig,
        "lora": LoraConfig,
        "preference": PreferenceConfig,
        "checkpoint": CheckpointConfig,
        "eval": EvalConfig,
        "elastic": ElasticConfig,
        "observe": ObserveConfig,
        "distributed": DistributedConfig,
        "decode": DecodeConfig,
    }
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}


def flat_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Flat key -> (section, field). Flat keys are unique across sections (checked here)."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in section_classes().items():
        for f in dataclasses.fields(cls):
            if f.name in out:
                raise AssertionError(f"config key {f.name!r} is declared in two sections")
            out[f.name] = (section, f)
    return out
