"""``moestream convert``: a Hugging Face directory or GGUF file -> an expert store;
``moestream verify``: check a store whole.

Registered on the ``moestream`` group by services.cli (``main.add_command(...)``).
"""

from __future__ import annotations

import sys

import click

from engine.errors import MoestreamError


@click.command("convert")
@click.argument("src", type=click.Path(exists=True))
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="Store directory to create (or resume, or leave alone when already finished).")
@click.option("--quant", type=click.Choice(["int4", "nf4", "int8", "bf16", "mxfp4"]), default="int4",
              show_default=True, help="Format of the routed experts (mxfp4: group 32; MXFP4 "
                                      "checkpoint experts are kept as released).")
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default="64", show_default=True,
              help="Weights per scale group (ignored by bf16).")
@click.option("--ple", "ple_dtype", type=click.Choice(["checkpoint", "int8"]), default="checkpoint",
              show_default=True, help="PLE n-gram tables (qwen4_exp): row files in the checkpoint's precision, "
                                      "or int8 with a per-row scale (half of bf16).")
@click.option("--dense-dtype", type=click.Choice(["auto", "bf16", "fp32"]), default="auto",
              show_default=True, help="Non-expert weights: auto keeps f16/bf16/f32 as stored.")
@click.option("--overwrite", is_flag=True,
              help="Replace a moestream store converted with other parameters (never other files).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
def convert(src, out, quant, group_size, ple_dtype, dense_dtype, overwrite, progress):
    """Convert SRC (HF checkpoint directory or .gguf) into a 4 KiB-aligned expert store."""
    try:
        from engine.quant.formats import QuantFormat
        from engine.store import convert as convert_store

        group = 32 if quant == "mxfp4" else int(group_size)  # one exponent per 32 weights
        summary = convert_store(src, out, fmt=QuantFormat(quant, group),
                                dense_dtype=dense_dtype, progress=progress, overwrite=overwrite,
                                ple_dtype=ple_dtype)
    except MoestreamError as e:  # typed, expected errors: one clear line, exit 2
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(str(summary))


@click.command("verify")
@click.argument("store", type=click.Path(file_okay=False))
@click.option("--max-errors", type=click.IntRange(min=1), default=20, show_default=True,
              help="Problems listed (the rest are counted).")
def verify(store, max_errors):
    """Check STORE whole: manifest, every expert blob's digest and identity, file sizes, the dense
    file and the tokenizer. Exit 0 when intact; otherwise one 'error:' line per problem, exit 2."""
    from engine.store import verify_store

    report = verify_store(store, max_problems=max_errors)
    click.echo(report.summary())
    for problem in report.problems:
        click.echo(f"error: {problem}", err=True)
    if report.more:
        click.echo(f"error: ... and {report.more} more problems", err=True)
    if not report.ok:
        sys.exit(2)
