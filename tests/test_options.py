"""The options are defined once (``reshard.core.options.ReshardOptions``): the CLI's flags and
the flow's parameters are made from it, and a bad value is the same typed error everywhere."""

from __future__ import annotations

import pytest

from reshard.cli import build_parser, main
from reshard.core.errors import LayoutError
from reshard.core.options import ReshardOptions, flag_of
from reshard.flows.params import ReshardParams


def _flags(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings}


@pytest.mark.parametrize("command", ["run", "plan"])
def test_every_option_is_a_flag_and_a_flow_parameter(command):
    flags = _flags(command)
    for name, field in ReshardOptions.model_fields.items():
        positive = field.default is not True  # a bool that defaults to True only has its negative flag
        assert (flag_of(name) in flags) == positive, name
        assert name in ReshardParams.model_fields, name
    assert {"--no-swiglu", "--no-mlp-extra-grouping"} <= flags


def test_flag_values_reach_the_options():
    ns = build_parser().parse_args(["plan", "x", "--target-tp", "4", "--no-swiglu", "--vocab-size", "50257",
                                    "--no-mlp-extra-grouping", "--version", "2"])
    from reshard.cli import parsed_options

    opts = parsed_options(ns, ns.target_tp)
    assert (opts.target_tp, opts.swiglu, opts.vocab_size, opts.mlp_extra_grouping, opts.version) == \
        (4, False, 50257, False, 2.0)
    assert opts == ReshardParams(source="a", destination="b", **opts.to_record()).options()


@pytest.mark.parametrize("field,value,match", [("target_tp", 0, "0 must be a positive integer"),
                                               ("target_pp", -1, "-1 must be a positive integer"),
                                               ("num_heads", 0, "must be a positive integer"),
                                               ("bits", 9, "9 does not fit int8"),
                                               ("groups", 0, "must be a positive integer")])
def test_a_bad_value_is_one_typed_error_everywhere(field, value, match, tmp_path, capsys):
    kwargs = {"target_tp": 2, field: value}
    for make in (lambda: ReshardOptions(**kwargs), lambda: ReshardParams(source="a", destination="b", **kwargs)):
        with pytest.raises(LayoutError, match=match) as info:
            make()
        assert info.value.culprit == flag_of(field)
    argv = ["plan", str(tmp_path), "--target-tp", str(kwargs["target_tp"]), flag_of(field), str(value)]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"reshard: error: {flag_of(field)}: ")
