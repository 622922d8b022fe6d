"""bench/readme_block.py: the README blocks the table scripts render from bench/results."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from readme_block import NoBlock, readme_cli, replaced  # noqa: E402

BEGIN, END = "<!-- t: rendered by test -->", "<!-- /t -->"


def test_a_block_is_replaced_whole_and_only_it() -> None:
    text = f"before\n{BEGIN}\nold 1\nold 2\n{END}\nafter {END}\n"
    assert replaced(text, BEGIN, END, "new") == f"before\n{BEGIN}\nnew\n{END}\nafter {END}\n"


def test_an_indented_block_keeps_its_indentation_on_every_line() -> None:
    text = f"- item\n  {BEGIN}\n  old\n  {END}\n- next\n"
    assert replaced(text, BEGIN, END, "| a |\n| b |") == f"- item\n  {BEGIN}\n  | a |\n  | b |\n  {END}\n- next\n"


def test_a_marker_after_text_on_its_line_leaves_that_text() -> None:
    text = f"see {BEGIN}\nold\n{END}"
    assert replaced(text, BEGIN, END, "new") == f"see {BEGIN}\nnew\n{END}"


@pytest.mark.parametrize("text", ["no markers", f"{BEGIN}\nonly the first", f"{END}\n{BEGIN}\nend before begin"])
def test_a_missing_marker_is_an_error_naming_both(text: str) -> None:
    with pytest.raises(NoBlock, match="no block .*add both lines"):
        replaced(text, BEGIN, END, "new")


def cli(argv: list[str]) -> int:
    return readme_cli(argv, doc=None, script="bench/t.py", what="the test's table",
                      rendered=lambda text: replaced(text, BEGIN, END, "rendered"), shown=lambda: "shown")


def test_the_cli_rewrites_checks_and_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{BEGIN}\ntyped by hand\n{END}\n")
    assert cli(["--check", str(readme)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the test's table is not what the JSON says" in err
    assert f"python3 bench/t.py --readme {readme}" in err
    assert cli(["--readme", str(readme)]) == 0
    assert readme.read_text() == f"# x\n{BEGIN}\nrendered\n{END}\n"
    assert cli(["--check", str(readme)]) == 0
    assert cli([]) == 0 and capsys.readouterr().out == "shown\n"


def test_the_cli_names_a_file_without_the_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no block\n")
    assert cli(["--readme", str(readme)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(readme) in err and "add both lines" in err
    assert readme.read_text() == "no block\n"


def test_the_cli_names_a_file_it_cannot_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "NOPE.md"
    assert cli(["--check", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(missing) in err
