"""Checkpoint saves and loads: the integrity manifest written after each save and verified before a
load, and the expert layout checked on resume."""

from __future__ import annotations

import functools
import time
from typing import Callable


def checkpoint_manifest_after_save(original: Callable) -> Callable:
    """``megatron.training.training.save_checkpoint``: waits for the previous checkpoint's
    manifest, runs upstream's save, then (a synchronous save: every rank's files are written)
    starts this rank's manifest part in the background; an asynchronous save is left to the next."""

    import inspect

    from megatron.bounded.training import checkpoint_integrity

    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(*args, **kwargs):
        from megatron.training.global_vars import get_args

        checkpoint_integrity.wait()  # the previous checkpoint's manifest is on disk first
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        options = get_args()
        directory = checkpoint_integrity.directory_for_save(
            options, call.arguments["iteration"], call.arguments["non_persistent_ckpt"],
            call.arguments["release"],
        )
        asynchronous = bool(getattr(options, "async_save", False))
        checkpoint_integrity.expect_async_save(directory if asynchronous else None)
        started = time.monotonic()
        try:
            result = original(*args, **kwargs)
        finally:
            checkpoint_integrity.expect_async_save(None)
        if directory is not None and not asynchronous:
            checkpoint_integrity.writer.start(directory, save_seconds=time.monotonic() - started)
        return result

    return save_checkpoint


def checkpoint_manifest_when_async_save_completes(original: Callable) -> Callable:
    """``megatron.training.checkpointing.schedule_async_save``: a last finalize step of the
    asynchronous save starts the manifest once every rank has written its files."""

    from megatron.bounded.training import checkpoint_integrity

    @functools.wraps(original)
    def schedule_async_save(async_request):
        checkpoint_integrity.on_async_save_scheduled(async_request)
        return original(async_request)

    return schedule_async_save


def verify_checkpoint_before_load(original: Callable) -> Callable:
    """``megatron.training.checkpointing._load_base_checkpoint``: the directory upstream will read
    is verified against its manifest first (``--no-verify-checkpoint`` skips it; a corrupt tracker
    file is refused either way); the ranks agree on whether upstream's load failed, so that all of
    them raise; after the load, a distributed-optimizer state saved with the other MoE expert class
    is refused."""

    from megatron.bounded.training import checkpoint_integrity

    @functools.wraps(original)
    def _load_base_checkpoint(load_dir, args, *rest, **kwargs):
        directory = checkpoint_integrity.directory_for_load(load_dir, args)
        if directory is not None:
            checkpoint_integrity.verify_before_load(
                directory, enabled=getattr(args, "verify_checkpoint", True)
            )
        result = checkpoint_integrity.agreed_load(
            directory or load_dir, lambda: original(load_dir, args, *rest, **kwargs)
        )
        state_dict = result[0] if isinstance(result, tuple) and result else None
        if isinstance(state_dict, dict) and "args" in state_dict:
            from megatron.bounded.moe.experts import check_expert_layout_on_resume

            check_expert_layout_on_resume(
                state_dict["args"], args, state_dict.get("content_metadata")
            )
        return result

    return _load_base_checkpoint
