"""``--kv-format`` and ``--kv-wide-layers`` reach the engine; bad values are refused by the
parser."""

import pytest

from agentkv.cli.main import build_parser
from agentkv.cli.serve import engine_format


@pytest.mark.parametrize("command", [["chat", "--agent", "a"], ["serve"]])
def test_kv_format_reaches_the_engine_options(command):
    parser = build_parser()
    assert engine_format(parser.parse_args(command)) == {}
    assert engine_format(parser.parse_args([*command, "--kv-format", "2"])) == {"kv_format": 2}
    assert engine_format(parser.parse_args([*command, "--kv-format", "1"])) == {"kv_format": 1}


@pytest.mark.parametrize("command", [["chat", "--agent", "a"], ["serve"]])
def test_kv_wide_layers_reach_the_engine_options(command):
    parser = build_parser()
    wide = [*command, "--kv-wide-layers"]
    assert engine_format(parser.parse_args([*wide, "auto"])) == {}
    assert engine_format(parser.parse_args([*wide, "none"])) == {"kv_wide_layers": ()}
    assert engine_format(parser.parse_args([*wide, "3,1"])) == {"kv_wide_layers": (3, 1)}


def test_other_kv_formats_are_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--agent", "a", "--kv-format", "3"])
    assert capsys.readouterr().err == (
        "agentkv chat: error: argument --kv-format: expected one of 1, 2, not '3' "
        "(`agentkv chat --help` lists the options)\n"
    )


@pytest.mark.parametrize("value", ["x", "1,,2", "-1", "1.5"])
def test_bad_wide_layers_are_refused(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--agent", "a", "--kv-wide-layers", value])
    assert "--kv-wide-layers" in capsys.readouterr().err
