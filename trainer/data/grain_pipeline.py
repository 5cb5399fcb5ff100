"""Training batches from ArrayRecord shards through Grain: shuffle, epochs, tokenization, packing.

The data order, and why it survives a change in the number of loader processes
-----------------------------------------------------------------------------
Global example k (k = 0, 1, 2, ...) is record `order[k]`, where `order` is Grain's global index
shuffle of all records, reseeded every epoch (`MapDataset.range(N).shuffle(seed).repeat()`): a pure
function of (files, data_shuffle_seed, epoch, position).

Row j of every global batch (R rows) is a *row stream*: it packs examples base + j, base + j + R,
base + j + 2R, ... in that order, greedily, as many whole documents as fit in max_target_length
(a document that does not fit starts the next row of the same stream). A row stream's state is one
integer, its cursor t (the next example is base + j + t*R), and row j of every later step is a pure
function of that cursor. The iterator state is therefore the R cursors: global, small, and the same
on every loader process, because every process advances every row stream (it tokenizes the whole
global batch and packs only its own rows). That costs each process the tokenization of the global
batch; in exchange any process count, any worker count and any resume point give the same global
batches. Pre-tokenized shards (scripts/prepare_data.py --tokenizer) make the extra work a read.

Grain worker processes (`grain_worker_count`) each own the row streams w, w + W, ... and produce one
element per step; Grain interleaves them round-robin, so worker count never changes a batch.

Preference pairs (objective=dpo): each row stream is a pair stream, one example (a preference record)
per step and no packing; pair stream j fills rows 2j (prompt + chosen) and 2j + 1 (prompt + rejected) of
the global batch, so a pair is never split across processes, devices or micro-steps that split the batch
into blocks of whole pairs (trainer.program.layout.batch_layout keeps them whole). The state is the pair
streams' cursors, as above.

Running out: with num_epoch >= 1 a row stream ends after the last example of the last epoch; its
rows are then padding, and the iterator stops when every row stream has ended (every process sees
that at the same step). num_epoch <= 0 repeats forever: `steps` bounds training.

Mixtures (`grain_train_files="a,0.7;b,0.3"`, trainer.config.mixture): each source has its own shuffled,
repeated order over its own records, and `order` is Grain's `MapDataset.mix` of them: a deterministic
weighted interleave in which global example k comes from source i at position p_i(k) of that source's
order. Everything above holds unchanged, because `order` is still a pure function of k: each source's
position is implied by the row cursors (the examples consumed so far), so restarts, kill -9, other
process counts and elastic resizes resume the mixture exactly like one source. Realised proportions:
any run of n consecutive examples holds n * w_i +- 1 of source i (Grain's weights are integers scaled
from the given ones, 100 for the smallest, so a weight is exact to 1%); a batch draws on consecutive
examples of each row stream, so the examples of a run deviate from the weights by at most about one
example per row stream and source. With num_epoch >= 1 the mixture ends when its first source has been
read num_epoch times (Grain's mix length), so no source repeats more often than asked.
"""

from __future__ import annotations

import json
import logging
import sys
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np
from etils import epath

from trainer.config.mixture import parse_mixture
from trainer.data.batch import BATCH_KEYS
from trainer.data.errors import DataError
from trainer.data.formatting import DocumentFormat, RecordError
from trainer.data.packing import empty_row, pack_row, pairs
from trainer.data.preference_records import pair_documents
from trainer.data.tokenizer import Tokenizer
from trainer.data.worker_lifetime import exit_with_parent
from trainer.io.paths import expand_globs, local_copy, looked_at

log = logging.getLogger(__name__)
STATE_KIND = "arrayrecord_row_streams"
STATE_VERSION = 1  # a mixture adds "mixture": [[records, weight], ...] per source; one source has none
MIX_WINDOW = 256  # examples whose order a mixture shuffles together (see data_order)


# ---- files and records --------------------------------------------------------------------------

SIDE_FILES = ("dataset_info.json",)  # written beside the shards by scripts/prepare_data.py


def resolve_files(pattern: str) -> list[epath.Path]:
    """Shards matching comma-separated globs, local (relative to the working directory, else the repo)
    or on an object store; the dataset's own side files and hidden files are not shards."""
    if not pattern.strip():
        raise DataError(
            "dataset_type=arrayrecord needs grain_train_files=<glob of .arrayrecord shards>, "
            "e.g. grain_train_files=data/fc_sample/*.arrayrecord"
        )
    files: list[epath.Path] = []
    for part, matches in expand_globs(pattern):
        shards = [m for m in matches if m.name not in SIDE_FILES and not m.name.startswith(".")]
        if not shards:
            raise DataError(
                f"grain_train_files: {part!r} matches no shard (looked at {looked_at(part)}); "
                "check the path, or make shards with scripts/prepare_data.py"
            )
        files += shards
    return files


def local_shards(files: list[epath.Path], cache_dir: str) -> list[str]:
    """Local paths for ArrayRecord's reader, which opens local files only: object-store shards are
    copied once per host into `cache_dir` (for data larger than local disk, mount the bucket, e.g.
    with gcsfuse, and give the mount's path instead)."""
    return [str(local_copy(f, cache_dir or None)) for f in files]


def count_records(path: str) -> int:
    """Records in one shard; DataError naming the file if it cannot be read as ArrayRecord."""
    from array_record.python import array_record_module

    try:
        with open(path, "rb") as f:
            f.read(1)
        reader = array_record_module.ArrayRecordReader(path, "readahead_buffer_size:0")
        n = reader.num_records()
        if n:
            reader.read([0, n - 1])
        reader.close()
    except Exception as e:  # noqa: BLE001 - OSError, RuntimeError from the C++ reader
        raise DataError(
            f"cannot read ArrayRecord shard {path}: {e}; regenerate it with "
            "scripts/prepare_data.py or drop it from grain_train_files"
        ) from None
    if n == 0:
        raise DataError(
            f"ArrayRecord shard {path} has no readable records (empty, truncated or not an "
            "ArrayRecord file); regenerate it with scripts/prepare_data.py or drop it from "
            "grain_train_files"
        )
    return n


class DocumentLoader:
    """Record index -> (ids, mask) document; errors name the shard and the record.

    Record indices run over the shards of every mixture source in turn; `source_records[i]` is the
    number of records of source i (one source: all of them)."""

    def __init__(
        self,
        files: list[str],
        counts: list[int],
        fmt: DocumentFormat,
        tok: Tokenizer,
        vocab_size: int,
        *,
        source_records: list[int] | None = None,
    ):
        self.files = files
        self.source_records = source_records or [int(sum(counts))]
        self.fmt = fmt
        self.tok = tok
        self.vocab_size = vocab_size
        self.ends = list(np.cumsum(counts))
        self.source = grain.sources.ArrayRecordDataSource(files)

    def where(self, index: int) -> str:
        shard = bisect_right(self.ends, index)
        start = self.ends[shard - 1] if shard else 0
        return f"{self.files[shard]} record {index - start}"

    def __call__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        try:
            ids, mask = self.fmt.document(self.source[index], self.tok)
        except RecordError as e:
            raise DataError(f"{self.where(index)}: {e}") from None
        self._check_ids(index, ids)
        return ids, mask

    def pair(self, index: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """[chosen, rejected] documents of preference record `index` (objective=dpo)."""
        try:
            docs = list(pair_documents(self.fmt, self.source[index], self.tok))
        except RecordError as e:
            raise DataError(f"{self.where(index)}: {e}; objective=dpo reads preference records") from None
        for ids, _ in docs:
            self._check_ids(index, ids)
        return docs

    def _check_ids(self, index: int, ids: np.ndarray) -> None:
        if len(ids) and (ids.max() >= self.vocab_size or ids.min() < 0):
            raise DataError(
                f"{self.where(index)}: token id {int(ids.max())} is outside the model's "
                f"vocab_size={self.vocab_size}; the record was pre-tokenized with another "
                "tokenizer: re-run scripts/prepare_data.py with this tokenizer_path"
            )


# ---- row streams: the Grain dataset the workers run ----------------------------------------------


@dataclass(frozen=True)
class StreamGeometry:
    """The static shape of the row streams: one per global-batch row (per pair of rows with `pairs`), row
    length, packing, end of data."""

    global_rows: int  # row streams (pair streams with `pairs`)
    length: int
    packing: bool
    limit: int | None  # examples in all epochs; None = repeat forever
    pairs: bool = False  # objective=dpo: each stream fills two rows from one preference record a step

    @property
    def rows_per_stream(self) -> int:
        return 2 if self.pairs else 1


class RowStreams(grain.IterDataset):
    """One element per global step: the next packed row of each of `rows` (arrays only for `own`)."""

    def __init__(
        self,
        order: grain.MapDataset,
        load: DocumentLoader,
        geometry: StreamGeometry,
        *,
        base: int,
        cursors: np.ndarray,
        rows: list[int],
        own: range,
    ):
        super().__init__()
        self.order = order
        self.load = load
        self.geometry = geometry
        self.base = base
        self.cursors = cursors
        self.rows = rows
        self.own = own

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Grain calls this in worker w of W with slice(w, None, W): the worker owns those row streams."""
        del sequential_slice  # row streams are already independent; there is nothing sequential to keep
        self.rows = self.rows[sl]

    def __iter__(self) -> RowStreamsIterator:
        return RowStreamsIterator(self)


class RowStreamsIterator(grain.DatasetIterator):
    """Runs inside a worker (or in-process): packs its row streams one global step at a time."""

    def __init__(self, ds: RowStreams):
        super().__init__()
        self.ds = ds
        self.cursors = {j: int(ds.cursors[j]) for j in ds.rows}
        self.pending: dict[int, tuple[int, tuple[np.ndarray, np.ndarray]]] = {}

    def _doc(self, row: int, k: int):
        cached = self.pending.pop(row, None)
        if cached is not None and cached[0] == k:
            return cached[1]
        return self.ds.load(int(self.ds.order[k]))

    def _fill(self, row: int) -> tuple[list, bool]:
        """Advance row stream `row` by one row: its documents, and whether the stream has ended."""
        geometry, ds = self.ds.geometry, self.ds
        docs, used, skipped = [], 0, 0
        t = self.cursors[row]
        if geometry.pairs:  # one preference record: its two documents, one per row, never packed
            k = ds.base + row + t * geometry.global_rows
            if geometry.limit is not None and k >= geometry.limit:
                return docs, True
            self.cursors[row] = t + 1
            return ds.load.pair(int(ds.order[k])), False
        while True:
            k = ds.base + row + t * geometry.global_rows
            if geometry.limit is not None and k >= geometry.limit:
                self.cursors[row] = t
                return docs, True
            doc = self._doc(row, k)
            n = pairs(doc[0])
            if n == 0:  # an empty document teaches nothing; skip it (still part of the order)
                t, skipped = t + 1, skipped + 1
                if skipped > 64 * len(ds.load.source):  # construction checked a sample: rare
                    raise DataError(
                        "no record yields a document of 2 or more tokens: the data set is "
                        "effectively empty; check text_field/messages_field and the shards"
                    )
                continue
            if docs and used + n > geometry.length:
                self.pending[row] = (k, doc)  # starts this stream's next row
                break
            docs.append(doc)
            used, t = used + n, t + 1
            if not geometry.packing or used >= geometry.length:
                break
        self.cursors[row] = t
        return docs, False

    def __next__(self) -> dict[str, np.ndarray]:
        length = self.ds.geometry.length
        out_rows, cursors, placed, ended, own, packed = [], [], [], [], [], []
        for row in self.ds.rows:
            docs, done = self._fill(row)
            out_rows.append(row)
            cursors.append(self.cursors[row])
            placed.append(len(docs))
            ended.append(done)
            if row in self.ds.own:
                own.append(row)
                if self.ds.geometry.pairs:
                    packed += [pack_row([d], length) for d in docs] if docs else [empty_row(length)] * 2
                else:
                    packed.append(pack_row(docs, length) if docs else empty_row(length))
        element = {
            "rows": np.asarray(out_rows, np.int64),
            "cursors": np.asarray(cursors, np.int64),
            "placed": np.asarray(placed, np.int32),
            "ended": np.asarray(ended, bool),
            "own": np.asarray(own, np.int64),
        }
        for key in BATCH_KEYS:
            element[key] = np.stack([p[key] for p in packed]) if packed else np.zeros((0, length), np.int32)
        return element

    def get_state(self) -> dict[str, Any]:
        return {"cursors": dict(self.cursors)}

    def set_state(self, state: dict[str, Any]) -> None:
        self.cursors = {int(j): int(t) for j, t in state["cursors"].items()}
        self.pending.clear()


# ---- the iterator the trainer uses ---------------------------------------------------------------


class ArrayRecordIterator:
    """This process's rows of each global batch; `get_state()` is global (the same on every process)."""

    def __init__(
        self,
        load: DocumentLoader,
        geometry: StreamGeometry,
        *,
        seed: int,
        num_epoch: int,
        weights: list[float],
        process_index: int,
        process_count: int,
        worker_count: int,
        worker_buffer_size: int,
    ):
        rows = geometry.global_rows // process_count  # row (pair) streams of this process
        self.load = load
        self.geometry = geometry
        self.seed = seed
        self.own = range(process_index * rows, (process_index + 1) * rows)
        self.worker_count = worker_count
        self.worker_buffer_size = worker_buffer_size
        self.order = data_order(load.source_records, weights, seed=seed, num_epoch=num_epoch)
        # [[records, weight], ...] of each source, in the state so a resume checks it reads the same mixture
        self.mixture = [[n, w] for n, w in zip(load.source_records, weights)] if len(weights) > 1 else None
        self.base = 0
        self.step = 0
        self.cursors = np.zeros(geometry.global_rows, np.int64)
        self._it = None
        self._exhausted = False

    def _pipeline(self):
        ds = RowStreams(
            self.order,
            self.load,
            self.geometry,
            base=self.base,
            cursors=self.cursors.copy(),
            rows=list(range(self.geometry.global_rows)),
            own=self.own,
        )
        workers = min(self.worker_count, self.geometry.global_rows)
        if workers > 0:
            _absl_flags_parsed()
            ds = ds.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=self.worker_buffer_size),
                worker_init_fn=exit_with_parent,  # a killed trainer leaves no worker behind
            )
        return iter(ds), max(workers, 1)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._exhausted:
            raise StopIteration
        if self._it is None:
            self._it = self._pipeline()
        it, elements_per_step = self._it
        elements = [next(it) for _ in range(elements_per_step)]
        if all(e["ended"].all() and not e["placed"].any() for e in elements):
            self._exhausted = True  # every row stream ran out: the state stays at the last real batch
            raise StopIteration
        per = self.geometry.rows_per_stream
        batch = {k: np.zeros((len(self.own) * per, self.geometry.length), np.int32) for k in BATCH_KEYS}
        for e in elements:
            self.cursors[e["rows"]] = e["cursors"]
            local = ((e["own"] - self.own.start)[:, None] * per + np.arange(per)).reshape(-1)
            for k in BATCH_KEYS:
                batch[k][local] = e[k]
        self.step += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        """JSON-serializable position after the last batch returned; independent of process_count."""
        return {
            "kind": STATE_KIND,
            "version": STATE_VERSION,
            "step": self.step,
            "num_records": len(self.load.source),
            "data_shuffle_seed": self.seed,
            "global_batch_size": self.geometry.global_rows,
            "base": int(self.base),
            "cursors": [int(c) for c in self.cursors],
            **({"mixture": self.mixture} if self.mixture else {}),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from `get_state()` of any run over the same files and seed, any process count."""
        if state.get("kind") != STATE_KIND or state.get("version") != STATE_VERSION:
            raise DataError(
                f"the checkpoint's data state is {state.get('kind')!r} v{state.get('version')}, "
                f"not {STATE_KIND!r} v{STATE_VERSION}: it was written by another dataset_type "
                "or version; resume with the dataset_type it was saved with"
            )
        if (state["num_records"], state["data_shuffle_seed"]) != (len(self.load.source), self.seed):
            raise DataError(
                f"the checkpoint's data order was over {state['num_records']} records with "
                f"data_shuffle_seed={state['data_shuffle_seed']}; now {len(self.load.source)} records "
                f"and seed {self.seed}: resume with the same grain_train_files and data_shuffle_seed"
            )
        if state.get("mixture") != self.mixture:
            raise DataError(
                f"the checkpoint's data mixture was {_describe(state.get('mixture'))}, now "
                f"{_describe(self.mixture)} ([records, weight] per grain_train_files entry): the data order "
                "would differ; resume with the grain_train_files it was saved with"
            )
        cursors = np.asarray(state["cursors"], np.int64)
        if state["global_batch_size"] == self.geometry.global_rows:
            self.base, self.cursors = int(state["base"]), cursors
        else:
            # A new row count has new row streams: start them all after the furthest example any old
            # stream reached. No example repeats; the few the slower old streams had not reached are skipped.
            old_rows = int(state["global_batch_size"])
            self.base = int(state["base"]) + old_rows * int(cursors.max(initial=0))
            self.cursors = np.zeros(self.geometry.global_rows, np.int64)
            skipped = int((cursors.max(initial=0) - cursors).sum())
            log.warning(
                "global batch changed from %d to %d rows: data order restarts at example %d "
                "(%d examples skipped, none repeated)",
                old_rows,
                self.geometry.global_rows,
                self.base,
                skipped,
            )
        self.step = int(state["step"])
        self._exhausted = False
        self._close_pipeline()

    def _close_pipeline(self) -> None:
        if self._it is not None:
            close = getattr(self._it[0], "close", None)
            if close is not None:
                close()
            self._it = None

    def close(self) -> None:
        self._close_pipeline()


def _describe(mixture) -> str:
    return "one source" if not mixture else str([[n, round(w, 6)] for n, w in mixture])


def data_order(source_records: list[int], weights: list[float], *, seed: int, num_epoch: int) -> grain.MapDataset:
    """Global example index -> record index: each source shuffled (reseeded every epoch) and repeated
    num_epoch times (<= 0: forever), then mixed by weight. One source keeps the plain shuffled order."""
    orders, start = [], 0
    for i, n in enumerate(source_records):
        # Source 0 uses the seed itself: a one-source run's order is the plain shuffle of its seed.
        order = grain.MapDataset.range(start, start + n).shuffle(seed=(seed + i) % 2**32)
        orders.append(order.repeat(num_epoch) if num_epoch > 0 else order.repeat())
        start += n
    if len(orders) == 1:
        return orders[0]
    mixed = grain.MapDataset.mix(orders, weights)
    # Grain's interleave is periodic (0.5/0.5 is ABAB...), and row j of a batch reads every R-th example:
    # unshuffled, whole rows would come from one source. Shuffling within windows of MIX_WINDOW examples
    # breaks that and keeps each window's proportions exact. A finite mixture drops its last partial window.
    window = min(MIX_WINDOW, len(mixed))
    if len(mixed) < sys.maxsize:
        mixed = mixed[: len(mixed) - len(mixed) % window]
    return grain.experimental.WindowShuffleMapDataset(mixed, window_size=window, seed=seed)


def _absl_flags_parsed() -> None:
    """Grain's worker processes read absl flags, which raise unless parsed; outside an absl app
    (our CLI, tests) nobody parses them, so take their defaults."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


# ---- construction: validate everything before training starts ------------------------------------


def make_arrayrecord_iterator(
    data_cfg, *, vocab_size: int, global_batch_size: int, process_index: int = 0, process_count: int = 1
) -> ArrayRecordIterator:
    """The Grain/ArrayRecord iterator for `data_cfg` (a DataConfig); DataError now if it cannot run.
    `global_batch_size` counts rows; under objective=dpo two per pair, and each process's block of rows
    must hold whole pairs."""
    per = 2 if data_cfg.dpo else 1
    if global_batch_size % (process_count * per) or not 0 <= process_index < process_count:
        whole = " of whole pairs (2 rows each)" if per == 2 else ""
        raise DataError(
            f"global batch of {global_batch_size} rows does not split into {process_count} "
            f"loader processes{whole} (process_index={process_index})"
        )
    if not 0 <= data_cfg.data_shuffle_seed < 2**32:
        raise DataError(f"data_shuffle_seed={data_cfg.data_shuffle_seed} must be in [0, 2**32)")
    tok = load_tokenizer(data_cfg, vocab_size)
    fmt = DocumentFormat(
        text_field=data_cfg.text_field,
        messages_field=data_cfg.messages_field,
        use_sft=data_cfg.sft,
        add_bos=data_cfg.add_bos,
        add_eos=data_cfg.add_eos,
        max_len=data_cfg.max_target_length,
    )
    mixture = parse_mixture(data_cfg.grain_train_files)
    shards = [resolve_files(source.pattern) for source in mixture]
    check_pretokenized_with(tok, [f for files in shards for f in files])
    files = [local_shards(s, data_cfg.data_cache_dir) for s in shards]
    counts = [[count_records(f) for f in source_files] for source_files in files]
    load = DocumentLoader(
        [f for source_files in files for f in source_files],
        [n for source_counts in counts for n in source_counts],
        fmt,
        tok,
        vocab_size,
        source_records=[sum(c) for c in counts],
    )
    weights = [source.weight for source in mixture]
    epochs = data_cfg.num_epoch
    order = data_order(load.source_records, weights, seed=data_cfg.data_shuffle_seed, num_epoch=epochs)
    if data_cfg.dpo:
        load.pair(int(order[0]))  # the first pair must read as one (a chat set is named here, not mid-run)
    else:
        check_documents(load, order)
    geometry = StreamGeometry(
        global_rows=global_batch_size // per,
        length=data_cfg.max_target_length,
        packing=data_cfg.packing and not data_cfg.dpo,
        limit=len(order) if epochs > 0 else None,
        pairs=data_cfg.dpo,
    )
    return ArrayRecordIterator(
        load,
        geometry,
        seed=data_cfg.data_shuffle_seed,
        num_epoch=epochs,
        weights=weights,
        process_index=process_index,
        process_count=process_count,
        worker_count=data_cfg.grain_worker_count,
        worker_buffer_size=data_cfg.grain_per_worker_buffer_size,
    )


def load_tokenizer(data_cfg, vocab_size: int) -> Tokenizer:
    """The configured tokenizer, checked against the model's vocabulary and the BOS/EOS settings."""
    tok = Tokenizer(data_cfg.tokenizer_path, data_cfg.tokenizer_type)
    if tok.vocab_size > vocab_size:
        raise DataError(
            f"tokenizer {tok.path} has {tok.vocab_size} tokens but the model's vocab_size is "
            f"{vocab_size}: ids would fall outside the embedding; use a model with vocab_size >= "
            f"{tok.vocab_size} or a smaller tokenizer (tokenizer_path)"
        )
    if data_cfg.add_eos and tok.eos_id is None:
        raise DataError(
            f"tokenizer {tok.path} has no EOS token (<|endoftext|> or </s>); set add_eos=false "
            "or use a tokenizer that has one"
        )
    if data_cfg.add_bos and tok.bos_id is None:
        raise DataError(
            f"tokenizer {tok.path} has no BOS token (<s>); set add_bos=false or use a tokenizer that has one"
        )
    return tok


def check_pretokenized_with(tok: Tokenizer, files: list[epath.Path]) -> None:
    """Shards pre-tokenized by scripts/prepare_data.py must be read with the tokenizer that made them."""
    for directory in sorted({f.parent for f in files}, key=str):
        info_path = directory / "dataset_info.json"
        if not info_path.is_file():
            continue
        try:
            made_with = (json.loads(info_path.read_text()).get("tokenizer") or {}).get("fingerprint")
        except (ValueError, AttributeError):
            raise DataError(f"{info_path} is not valid JSON; re-run scripts/prepare_data.py") from None
        if made_with is not None and made_with != tok.fingerprint():
            raise DataError(
                f"{directory} was pre-tokenized with another tokenizer ({info_path} records "
                f"fingerprint {made_with}, {tok.path} is {tok.fingerprint()}); set tokenizer_path to "
                "the one it was made with, or re-run scripts/prepare_data.py"
            )


def check_documents(load: DocumentLoader, order: grain.MapDataset, sample: int = 32) -> None:
    """The first record of every shard and the first records of the order must load (fields, template,
    ids in range), and not all of them may be empty."""
    indices = sorted({0, *load.ends[:-1], *(order[i] for i in range(min(sample, len(order))))})
    if all(pairs(load(int(i))[0]) == 0 for i in indices):
        raise DataError(
            f"the {len(indices)} records checked all yield fewer than 2 tokens: the data set is "
            "effectively empty; check text_field/messages_field and the shards"
        )
