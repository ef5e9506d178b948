"""What a bundle may declare at most (:class:`Limits`), and the checks against the host's limits:
thread and replica caps (:func:`check_caps`) and the compression ratio of a zip member (:func:`check_ratio`)."""

from __future__ import annotations

import zipfile
from collections.abc import Collection
from dataclasses import dataclass

from onnxpipe._errors import BundleError
from onnxpipe.runtime._settings import host_cores
from onnxpipe.runtime._spec import PipelineSpec

__all__ = ["Limits", "check_caps", "check_ratio"]

#: Zip members of this many bytes and less, unpacked, are exempt from the compression ratio (see :func:`check_ratio`).
_SMALL_MEMBER = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What a bundle may declare at most; anything larger is refused before it is read.

    Attributes:
        max_files: Files in the bundle.
        max_file_bytes: Size of one file.
        max_total_bytes: Size of all files together.
        max_json_bytes: Size of the config and of the manifest.
        max_compression_ratio: Unpacked size over compressed size of an archive member (members
            of 1 MiB and less unpacked are exempt: they cannot exhaust anything).
        max_reference_bytes: Bytes of all reference arrays together, as their headers declare.
        max_threads: Intra-op and inter-op threads of one stage session (``None``: 4 x the cores
            this process may use).
        max_replicas: Replicas of one stage (``None``: 4 x the cores this process may use).
        max_pipeline_threads: Threads of all stages together, every replica's worker and thread
            pools counted (``None``: 16 x the cores this process may use).

    Only the host sets these (``load(..., limits=Limits(...))``); nothing in a bundle changes them.
    """

    max_files: int = 10_000
    max_file_bytes: int = 64 << 30
    max_total_bytes: int = 256 << 30
    max_json_bytes: int = 16 << 20
    max_compression_ratio: float = 100
    max_reference_bytes: int = 1 << 30
    max_threads: int | None = None
    max_replicas: int | None = None
    max_pipeline_threads: int | None = None


def check_caps(spec: PipelineSpec, limits: Limits, stages: Collection[str] | None = None) -> None:
    """Refuse stage settings that would start more threads or replicas than this host allows.

    Args:
        spec: The pipeline.
        limits: The host's limits.
        stages: The stages whose sessions this host starts (default: all of them). With the Ray
            engine the driver starts none, and each actor checks its own stage against its node.

    Note: thread and replica caps.
        A bundle's settings are the builder's wish, not the host's: ``intra_op_threads: 2000``
        would start thousands of threads. Each of a stage's ``intra_op_threads``,
        ``inter_op_threads`` and ``replicas`` is capped at ``4 x`` the cores this process may use
        (more never runs faster, but a bundle built on a bigger host still loads), and the threads
        of all stages together (:meth:`StageSettings.thread_count` per replica) at ``16 x``. The
        host changes them with :class:`Limits`; nothing in a bundle does. A setting over its cap
        is refused rather than lowered silently, like every other limit.
    """
    cores = host_cores()

    def cap(value: int | None, times: int, knob: str) -> tuple[int, str]:
        if value is not None:
            return value, f"Limits.{knob}"
        return times * cores, f"{times} x the {cores} core(s) this process may use"

    how = ("lower it in the bundle's settings, or raise the cap on this host with load(..., limits=Limits({}=...)); "
           "or lower it at load: load(..., overrides=...), onnxpipe serve/run/bench --set")
    threads, threads_why = cap(limits.max_threads, 4, "max_threads")
    replicas, replicas_why = cap(limits.max_replicas, 4, "max_replicas")
    here = [stage for stage in spec.stages if stages is None or stage.name in stages]
    for stage in here:
        s = stage.settings
        for setting, value, most, why, knob in (
            ("intra_op_threads", s.intra_op_threads, threads, threads_why, "max_threads"),
            ("inter_op_threads", s.inter_op_threads, threads, threads_why, "max_threads"),
            ("replicas", s.replicas, replicas, replicas_why, "max_replicas"),
        ):
            if value > most:
                raise BundleError(f"stage '{stage.name}': {setting} {value} is over this host's cap of {most} ({why}); " + how.format(knob))
    total, total_why = cap(limits.max_pipeline_threads, 16, "max_pipeline_threads")
    count = sum(s.settings.replicas * s.settings.thread_count(cores) for s in here)
    if count > total:
        raise BundleError(f"the stages' settings start {count} threads in all; this host's cap is {total} ({total_why}); " + how.format("max_pipeline_threads"))


def check_ratio(member: zipfile.ZipInfo, name: str, limits: Limits, what: str) -> None:
    """Refuse a zip member that inflates more than ``max_compression_ratio`` times (a zip bomb)."""
    # Small members are exempt: legitimate small files (a JSON file, a module of zeros) can deflate
    # beyond any sane ratio, and 1 MiB cannot exhaust anything.
    if member.file_size > _SMALL_MEMBER and member.file_size > limits.max_compression_ratio * member.compress_size:
        ratio = member.file_size / max(member.compress_size, 1)
        raise BundleError(
            f"{what} '{name}' inflates {member.compress_size} bytes to {member.file_size} (ratio {ratio:.0f}:1); "
            f"the limit is {limits.max_compression_ratio:g}:1 (a host that trusts the bundle can raise it with "
            "Limits(max_compression_ratio=...))"
        )
