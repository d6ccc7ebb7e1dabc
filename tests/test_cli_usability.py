"""What a person sees at the command line (#29): text printed as written, bare commands that list what to
type, did-you-mean for strategy names and flags, metavars a person can read. All in-process, no runs."""

import argparse
import re

import pytest
from rich.console import Console

from parallel import cli, preflight, strategies
from parallel.judge import mutants
from parallel.loop.results import Equivalence


def rendered(print_to) -> str:
    console = Console(width=400, record=True, color_system=None)
    print_to(console)
    return console.export_text()


def test_mutants_list_prints_descriptions_with_their_brackets(capsys):
    assert cli.main(["mutants", "--list"]) == 0
    out = capsys.readouterr().out
    assert "one fused [q | k | v] matrix" in out  # rich markup used to take "[q | k | v]" for a tag and drop it
    assert '{"options": {"bucket_mb": 1}}' in out


def test_the_mutants_table_prints_in_100_columns_with_names_as_written():
    # the catalogue's longest name and a tensor name with brackets, at the width of a pipe or CI's log: every
    # column still shows its whole value (the bug's description and run once squeezed the ratio to nothing)
    longest = max(strategies.mutants(), key=len)
    outcomes = [mutants.Outcome(longest, longest.split(":")[0], "transformer", "cpu:2", 0,
                                Equivalence("mismatch", 1.0, 0.1, worst_tensor="blocks.0.[q]", ratio=250000.0,
                                            first_step=3), True, 1.0),
                mutants.Outcome("ddp:sum-not-mean", "ddp", "mlp", "cpu:2", 0,
                                Equivalence("mismatch", 1.0, 0.1, worst_tensor="model.layers.0.self_attn.k_norm."
                                            "weight", ratio=6.5, first_step=0), False, 1.0)]
    console = Console(width=100, record=True, color_system=None)
    mutants.show_mutants(outcomes, console)
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 100
    row = next(line for line in text.splitlines() if line.strip().startswith(longest))
    assert "mismatch" in row and "2.5e+05" in row and " 3 " in row, row
    assert "blocks.0.[q]" in text and "6.5" in next(x for x in text.splitlines() if "ddp:sum-not-mean" in x)
    assert " ".join(text.split()).endswith(f"missed 1 of the 2 the oracle judges: {longest}.")


def test_preflight_table_prints_details_as_written():
    check = preflight.Check("ddp on cpu:2", "[q | k | v] proves", "failed", "RuntimeError: shape [b | s] (log: x)")
    text = rendered(lambda console: console.print(preflight.table([check])))
    assert "[q | k | v] proves" in text and "shape [b | s]" in text


@pytest.mark.parametrize("argv, usage, commands", [
    ([], "usage: python -m parallel COMMAND", ["devices", "compare", "run", "bench", "sweep", "preflight", "mutants"]),
    (["bench"], "usage: python -m parallel bench KIND", ["cpu-vs-gpu", "streams", "memory"]),
])
def test_a_bare_command_lists_its_commands_with_what_each_does(argv, usage, commands, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage)
    lines = err.splitlines()
    for name in commands:  # one line a command: its name, then its one-line help
        (line,) = [x for x in lines if x.split()[:1] == [name]]
        assert len(line.split()) > 2, line
    assert "--help" in lines[-1]


@pytest.mark.parametrize("argv, message", [
    (["compare", "--strategies", "dpp"], "error: unknown strategy 'dpp' (did you mean 'ddp'?); valid strategies: "
                                         + ", ".join(strategies.NAMES)),
    (["compare", "--strategies", "single,fdsp"], "unknown strategy 'fdsp' (did you mean 'fsdp'?)"),
    (["run", "dpp"], "error: unknown strategy 'dpp' (did you mean 'ddp'?); valid strategies: "),
    (["preflight", "--strategies", "pipline"], "unknown strategy 'pipline' (did you mean 'pipeline'?)"),
    (["compare", "--stepz", "3"], "error: unrecognized argument --stepz (did you mean --steps?)"),
    (["compare", "--stepz=3"], "error: unrecognized argument --stepz (did you mean --steps?)"),
    (["run", "ddp", "--bucketmb", "4"], "error: unrecognized argument --bucketmb (did you mean --bucket-mb?)"),
    (["bench", "memory", "--budgetmb", "3"], "bench memory: error: unrecognized argument --budgetmb (did you mean "
                                             "--budget-mb?)"),
    (["sweep", "--lrr", "0.1"], "error: unrecognized argument --lrr (did you mean --lr?)"),
    (["compar"], "invalid choice: 'compar' (did you mean 'compare'?)"),
])
def test_near_misses_are_refused_with_the_name_meant(argv, message, refused):
    refused(argv, message)


def test_no_close_match_keeps_the_plain_message(refused):
    refused(["compare", "--strategies", "nosuch"],
            f"error: unknown strategy 'nosuch'; valid strategies: {', '.join(strategies.NAMES)}")
    refused(["compare", "--zzzzzz", "1"], "error: unrecognized argument --zzzzzz")


def _parsers(parser: argparse.ArgumentParser, name: str = "python -m parallel"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_option_has_a_metavar_a_person_can_read():
    unreadable = []
    for name, parser in _parsers(cli.build_parser()):
        for a in parser._actions:
            if a.option_strings and a.nargs != 0:
                shown = a.metavar or a.dest.upper()
                if "_" in shown or shown.startswith("OPTION"):
                    unreadable.append(f"{name} {a.option_strings[-1]} {shown}")
    assert unreadable == []


@pytest.mark.parametrize("argv, expected", [
    (["compare"], ["--bucket-mb MB[,MB...]", "--batch-size N", "--world-size N", "--strategies LIST",
                   "--microbatches N[,N...]", "--model FILE:FACTORY", "--out DIR"]),
    (["run"], ["run [-h]", "STRATEGY", "--pg-timeout SECONDS", "--checkpoint-every K"]),
    (["sweep"], ["--batch-size LIST", "--num-workers LIST", "--steps N"]),
    (["bench", "memory"], ["--budget-mb MB", "--batch-size N"]),
])
def test_help_shows_readable_metavars(argv, expected, capsys):
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "OPTION_" not in text and "BATCH_SIZE" not in text
    for piece in expected:
        assert piece in text, piece


def test_compare_and_plan_take_a_sequence_length_under_either_spelling():
    # One description of a model for both commands (#44): compare's --seq-len and plan's --seq, each in both.
    parser = cli.build_parser()
    for flag in ("--seq-len", "--seq"):
        assert parser.parse_args(["compare", flag, "64"]).seq_len == 64
        assert parser.parse_args(["plan", flag, "1024"]).seq == 1024
