"""The README's two set-up commands are the project's real entry points, and CI runs exactly
the test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- readme-commands[^>]*-->\s*```bash\n(.*?)```", text, re.S)
    assert block, "README.md lost its marked block of set-up commands"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_the_up_and_test_commands() -> None:
    assert readme_commands() == ["./scripts/up", "./scripts/test"]
    for command in readme_commands():
        script = ROOT / command.removeprefix("./")
        assert script.is_file() and script.stat().st_mode & 0o111, f"{script} is not executable"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in ci if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == f"exec {readme_commands()[1]}"


def test_the_up_script_starts_bulletin_up_and_the_test_script_runs_pytest() -> None:
    up = (ROOT / "scripts" / "up").read_text()
    test = (ROOT / "scripts" / "test").read_text()
    assert "bulletin up" in up and "pip install" in up
    assert "-m pytest" in test and "'.[test]'" in test


def test_every_daemon_option_is_described_in_help() -> None:
    import click

    from bulletin import cli

    for name in ("gateway", "nodelet", "up"):
        command = cli.get_command(click.Context(cli), name)
        assert command is not None
        bare = [
            p.name
            for p in command.params
            if isinstance(p, click.Option)
            and not (p.help or "").split("[default")[0].strip()
            and p.name != "help"
        ]
        assert not bare, f"'bulletin {name}' options without a description: {bare}"
