"""Checkpoints of a training run: atomic, verified, resumable bit-identically, loadable for inference.

The package: `find.py` (names, the latest pointer, the manifest, meta.json), `save.py`, `load.py`,
`safe_read.py` (DCP's files read without running anything) and `shards.py` (what each rank holds, as
pieces of the full tensors). Both training and serving read it.

Responsible for: saving model + optimizer state with `torch.distributed.checkpoint` (DCP; it needs no
process group on one process and reshards under another layout when there is one), the weights again
as safetensors (what inference reads), a `meta.json` (format, step, world size, the config as a dict),
one `rank_XXXXX.json` per rank with that rank's extras (RNG states, data loader position: plain JSON;
which rank's file to read after a change of layout is the trainer's call), and `manifest.json`, written
last: the size and sha256 of every file. Publication is atomic and durable (every rank fsyncs what it
wrote; rank 0 writes the manifest, renames `step_N.tmp/` to `step_N/`, then atomically replaces the
`latest` pointer, and only then prunes, keeping the last `keep`). Loading verifies the manifest before
anything is parsed and refuses a damaged, incomplete or mismatched checkpoint (or a model config that
differs) with one line naming the file and the fix; `--resume` falls back to the newest complete
checkpoint when `latest` is damaged (`resume_checkpoint`), and `meshlm train --resume` checks all of that
before it starts any rank (`check_run_dir`), and each rank once more before it reads anything (checksums
cost a read of the checkpoint per check; `checksums=False` where the caller has just verified).
Not responsible for: deciding when to save or whether a run_dir may be reused (the trainer), or Hugging
Face formats (`models/hf.py`).

Nothing in a checkpoint runs code: `generate`, `serve` and `LLM` read meta.json, the manifest and the
safetensors only; resuming (and a restart) reads DCP's `.metadata`, a pickle, with an unpickler that
admits only DCP's metadata classes, and DCP's stored values with torch's `weights_only` one (`safe_read.py`)
-- the manifest's checksums guard against damage, this against a crafted checkpoint. A fix a refusal
names (an earlier checkpoint) is one that verifies itself; `--overwrite` deletes only meshlm's own entries.

The state is always stored in the per-parameter layout of one unsharded model and `torch.optim.AdamW`,
and every rank writes only the pieces of it that it holds, each at its offsets in the full tensor
(`checkpoint/shards.py`: tensor/expert-parallel shards from their `_meshlm_shard` tags, ZeRO's flat ranges
cut into rectangles of their parameters); a piece several ranks hold is written once. On load DCP reads
into each rank's pieces exactly the parts of the saved ones they overlap, so a checkpoint moves between
any two layouts (dp, ZeRO stage, tp, pp, ep, cp, world size; one process included) and no rank ever
builds a full tensor, saving or loading. The safetensors copy of the weights is written the same way, in
pieces (their places in its metadata); inference puts the full tensors together.

With several ranks every rank calls `save_checkpoint` (DCP's save is collective over the default
process group), all into the same directory, so a multi-node run needs a shared filesystem for
`run_dir`; rank 0 alone publishes, after a barrier.

Layout::

    <run_dir>/checkpoints/latest            text file: "step_000123"
    <run_dir>/checkpoints/step_000123/      .metadata + *.distcp (DCP), model_rank_*.safetensors (one per
                                            pipeline stage), meta.json, rank_00000.json, ..., manifest.json
"""

from meshlm.checkpoint.find import (  # noqa: F401 (the package's API)
    CheckpointError,
    check_model_config,
    check_run_dir,
    checkpoint_dir_name,
    checkpoints_root,
    config_from_dict,
    has_complete_checkpoint,
    latest_checkpoint,
    meshlm_entries,
    read_meta,
    resolve_checkpoint,
    resume_checkpoint,
    saved_layout,
    verify_checkpoint,
)
from meshlm.checkpoint.save import (  # noqa: F401 (the package's API)
    PendingSave,
    begin_save,
    finish_save,
    rng_state,
    save_checkpoint,
)
from meshlm.checkpoint.load import (  # noqa: F401 (the package's API)
    load_checkpoint,
    load_checkpoint_for_inference,
    load_weights,
    set_rng_state,
)
