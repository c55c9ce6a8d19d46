"""Attempt directories kept for an owner's next call (nodelet.attempt._Files): reused only
empty and for the same owner and account, bounded per owner and in all, expired when
nobody reuses them, all removed when the nodelet stops. Real directories, the nodelet's own
account (single-tenant)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from nodelet import attempt
from nodelet.attempt import _Files, removals_done


async def finished(work_dir: Path, owner: str, *, leave: str | None = None) -> _Files:
    """An attempt's directory as a cleanly ended call leaves it, closed."""
    files = _Files.make(str(work_dir), None, owner)
    if leave is not None:
        (Path(files.out) / leave).write_text("x")
    files.keep = True
    await files.close()
    return files


def test_kept_directories_are_reused_by_their_owner_only_bounded_and_expired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(attempt.time, "monotonic", lambda: clock[0])

    async def main() -> None:
        first = await finished(tmp_path, "alice", leave="outcome")
        assert Path(first.path).is_dir() and not any(Path(first.out).iterdir())
        # Alice's next call gets it back; Bob's never does.
        bobs = _Files.make(str(tmp_path), None, "bob")
        assert bobs.path != first.path
        again = _Files.make(str(tmp_path), None, "alice")
        assert again.path == first.path
        # At most _KEEP_PER_OWNER are kept for one owner; the rest are removed.
        many = attempt._KEEP_PER_OWNER + 2
        made = [_Files.make(str(tmp_path), None, "carol") for _ in range(many)]
        for files in made:
            files.keep = True
            await files.close()
        assert sum(Path(f.path).exists() for f in made) == attempt._KEEP_PER_OWNER
        await removals_done(10)
        assert not any(Path(f.path).exists() for f in made), "a stopping node removes them"
        # Kept again after a stop; one left unused past _KEEP_S is removed at the next make.
        late = await finished(tmp_path, "dave")
        clock[0] += attempt._KEEP_S + 1
        fresh = _Files.make(str(tmp_path), None, "dave")
        assert fresh.path != late.path
        await removals_done(10)
        assert not Path(late.path).exists()
        for files in (bobs, again, fresh):
            await files.close()

    asyncio.run(main())
    assert sorted(os.listdir(tmp_path)) == []


def test_a_kept_directory_with_something_mounted_over_it_is_not_reused(tmp_path: Path) -> None:
    """Its account may mount over its own ``out`` (FUSE, where fusermount is installed): the
    descriptor the nodelet holds is then no longer what the call would work in. Here a bind
    mount as root stands in for it."""
    import subprocess

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()

    async def main() -> None:
        kept = await finished(work, "alice")
        subprocess.run(["mount", "--bind", str(elsewhere), kept.out], check=True)
        try:
            fresh = _Files.make(str(work), None, "alice")
            assert fresh.path != kept.path, "a directory with a mount over out was reused"
            await fresh.close()
        finally:
            subprocess.run(["umount", kept.out], check=True)
        await removals_done(10)

    asyncio.run(main())
    assert sorted(os.listdir(work)) == []


def test_a_directory_is_kept_at_once_only_when_its_call_ended_cleanly_and_left_little(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        # The outcome read, the next item of the owner's map gets the directory right away.
        files = _Files.make(str(tmp_path), None, "alice")
        (Path(files.out) / "outcome").write_text("x")
        files.keep = True
        assert files.kept_now() and not any(Path(files.out).iterdir())
        assert _Files.make(str(tmp_path), None, "alice").path == files.path
        # Not when the call did not end cleanly, nor when it left a directory behind: those
        # are removed later, as the account where they are the account's.
        unclean = _Files.make(str(tmp_path), None, "bob")
        assert not unclean.kept_now()
        left = _Files.make(str(tmp_path), None, "bob")
        (Path(left.out) / "sub").mkdir()
        left.keep = True
        assert not left.kept_now()
        for rest in (unclean, left):
            await rest.close()
            assert not Path(rest.path).exists()
        await removals_done(10)

    asyncio.run(main())
