"""What several commands share."""

from __future__ import annotations


def require_extra(extra: str, *modules: str) -> None:
    """Raise ValueError naming the pip extra that brings `modules` when one of them is missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"this command needs {', '.join(missing)} (the [{extra}] extra): "
                         f"pip install -e \".[{extra}]\" (or pip install meshlm[{extra}])")


def serving_ranks(args) -> int:
    """The ranks of `meshlm generate` / `meshlm serve`: --tp x --cp (ValueError unless both are >= 1)."""
    if args.tp < 1 or args.cp < 1:
        raise ValueError(f"--tp={args.tp} and --cp={args.cp} must be >= 1")
    return args.tp * args.cp


def in_process_group(work, device_type: str, **init_kwargs) -> int:
    """`work()` on this rank of a launch, between the start of the process group (`init_distributed`'s
    `init_kwargs`) and its teardown; returns what `work` returns."""
    from meshlm.distributed import init_distributed, teardown_distributed

    init_distributed(device_type, **init_kwargs)
    try:
        code = work()
    except BaseException:
        teardown_distributed()  # no waiting for ranks that may never arrive: the launcher stops them
        raise
    teardown_distributed(wait=True)
    return code
