"""``--kv-format`` reaches the engine; anything but 1 or 2 is refused by the parser."""

import pytest

from agentkv.cli.main import build_parser
from agentkv.cli.serve import engine_format


@pytest.mark.parametrize("command", [["chat", "--agent", "a"], ["serve"]])
def test_kv_format_reaches_the_engine_options(command):
    parser = build_parser()
    assert engine_format(parser.parse_args(command)) == {}
    assert engine_format(parser.parse_args([*command, "--kv-format", "2"])) == {"kv_format": 2}
    assert engine_format(parser.parse_args([*command, "--kv-format", "1"])) == {"kv_format": 1}


def test_other_kv_formats_are_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--agent", "a", "--kv-format", "3"])
    assert "invalid choice" in capsys.readouterr().err
