"""The conversion's progress bar (bytes read, on stderr), or nothing with `--quiet`."""

from __future__ import annotations

import sys


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        desc="convert",
        mininterval=0.5,
        dynamic_ncols=True,
    )
