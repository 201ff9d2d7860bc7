"""The settings reference stays complete: every `KIMI_DECODE_*` variable the package reads is documented in
docs/switches.md, and the docs name none that the package no longer reads."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"KIMI_DECODE_[A-Z0-9_]*[A-Z0-9]")
READ = re.compile(r"[\"'](KIMI_DECODE_[A-Z0-9_]*[A-Z0-9])[\"']")  # as the code passes it to os.environ / env_choice


def _names(paths, pattern=NAME) -> set[str]:
    return {n for p in paths for n in pattern.findall(p.read_text())}


def _read() -> set[str]:
    return _names((ROOT / "kimi_decode").rglob("*.py"), READ)


def test_every_setting_the_package_reads_is_documented():
    read = _read()
    documented = _names([ROOT / "docs" / "switches.md"])
    assert len(read) > 50  # the scan finds the settings at all
    assert sorted(read - documented) == []


def test_the_docs_name_only_settings_that_exist():
    read = _read()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert sorted(_names([doc]) - read) == [], doc.name
