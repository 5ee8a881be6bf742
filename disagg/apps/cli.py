"""The `disagg` command: every demo, benchmark and tool, as thin typer commands.

Commands parse options into config dataclasses, call library functions and print with rich; no
serving logic lives here. Errors the user can fix print one line and exit with code 2.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from disagg.apps import front_door_commands  # noqa: F401 - adds serve cluster|router
from disagg.apps.bench_commands import register as register_bench
from disagg.apps.config_command import register as register_config
from disagg.apps.figures.commands import register as register_figures
from disagg.apps.models_command import register as register_models
from disagg.apps.options import (
    DECODER,
    DEFAULT_MODEL,
    ROUTING,
    SHARED,
    ChunkOption,
    CudaGraphOption,
    DecodeTpOption,
    DeviceOption,
    DraftLayersOption,
    DraftTokensOption,
    DtypeOption,
    KVDtypeOption,
    LayoutOption,
    ModelOption,
    NodeOptions,
    NumPagesOption,
    PageSizeOption,
    PrefillTpOption,
    RoutingMarginOption,
    RoutingOption,
    SpeculativeOption,
    TpOption,
    with_node_options,
)
from disagg.apps.serve_commands import serve_app
from disagg.apps.topology_command import register as register_topology
from disagg.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    check_dtype,
    check_kv_layout,
)
from disagg.errors import DisaggError, RequestError
from disagg.node.cluster_config import THREADS_PER_NODE
from disagg.node.node_options import KV_DTYPE_AUTO, OPTION_DEFAULTS, speculative_config
from disagg.node.prefix_index import LOAD_MARGIN
from disagg.sim.commands import register as register_sim_commands

app = typer.Typer(help="Disaggregated LLM prefill and decode: a readable reference.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
register_bench(app)
register_sim_commands(app)
app.add_typer(serve_app, name="serve")
register_figures(app)
register_topology(app)
register_models(app)
register_config(app)
console = Console()
err_console = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        sys.stdout.write(f"disagg {version('disagg')}\n")
        raise typer.Exit


@app.callback()
def _root(_version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version,
        help="Print the installed version and exit")] = False) -> None:
    """Disaggregated LLM prefill and decode: a readable reference."""


def parse_token_ids(text: str) -> list[int]:
    """"1,2,3" -> [1, 2, 3], with an error naming the bad item."""
    ids = []
    for item in text.split(","):
        item = item.strip()
        if not item.lstrip("-").isdigit() or int(item) < 0:
            raise RequestError(f"--prompt-token-ids: {item!r} is not a token id")
        ids.append(int(item))
    return ids


@app.command()
def generate(
    model: ModelOption,
    prompt: Annotated[str | None, typer.Option(help="Prompt text (needs a tokenizer)")] = None,
    prompt_token_ids: Annotated[str | None, typer.Option(help="Prompt as ids: 1,2,3")] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most")] = 32,
    kv_layout: LayoutOption = OPTION_DEFAULTS["kv_layout"],
    page_size: PageSizeOption = OPTION_DEFAULTS["page_size"],
    num_pages: NumPagesOption = OPTION_DEFAULTS["num_pages"],
    chunk_size: ChunkOption = OPTION_DEFAULTS["chunk_size"],
    temperature: Annotated[float, typer.Option(help="0 means greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0: all)")] = 0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    trace: Annotated[str | None, typer.Option(
        help="Write a Chrome/Perfetto trace of the engine steps to this JSON file")] = None,
    speculative: SpeculativeOption = None,
    num_draft_tokens: DraftTokensOption = OPTION_DEFAULTS["num_draft_tokens"],
    draft_layers: DraftLayersOption = OPTION_DEFAULTS["draft_layers"],
    device: DeviceOption = OPTION_DEFAULTS["device"],
    cuda_graph: CudaGraphOption = OPTION_DEFAULTS["cuda_graph"],
    tp: TpOption = OPTION_DEFAULTS["tp"],
    dtype: DtypeOption = OPTION_DEFAULTS["dtype"],
    kv_dtype: KVDtypeOption = OPTION_DEFAULTS["kv_dtype"],
) -> None:
    """Generate text for one prompt on a single node (paged KV cache, chunked prefill)."""
    from disagg.apps.generate import generate_one
    from disagg.apps.progress import StartupProgress
    from disagg.node.node_config import check_device
    from disagg.utils.trace import Tracer

    if (prompt is None) == (prompt_token_ids is None):
        raise RequestError("give exactly one of --prompt or --prompt-token-ids")
    config = EngineConfig(
        model=None,  # type: ignore[arg-type]  # filled from the checkpoint by generate_one
        cache=CacheConfig(page_size=page_size, num_pages=num_pages,
                          kv_layout=check_kv_layout(kv_layout),
                          dtype=check_dtype(dtype if kv_dtype == KV_DTYPE_AUTO else kv_dtype)),
        scheduler=SchedulerConfig(chunk_size=chunk_size,
                                  max_num_batched_tokens=max(chunk_size, 1)),
        parallel=ParallelConfig(tp), device=check_device(device), dtype=check_dtype(dtype),
        cuda_graph=cuda_graph)
    stream = None if as_json else _print_now
    tracer = Tracer(trace, "generate")
    loading = f"loading {model}"

    def loaded() -> None:  # before the first token: the status line must not cut the text
        progress.end(loading, f"[green]✓[/green] {model} loaded")
        progress.close()

    with StartupProgress() as progress:
        progress.begin(loading)
        result = generate_one(
            model, config, prompt=prompt, prompt_token_ids=None if prompt_token_ids is None
            else parse_token_ids(prompt_token_ids),
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, on_text=stream, tracer=tracer, on_loaded=loaded,
            speculative=speculative_config(speculative, num_draft_tokens, draft_layers))
    tracer.close()
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        _print_now("\n")
        err_console.print(f"[dim]{len(result['token_ids'])} tokens, finish: "
                          f"{result['finish_reason']}[/dim]")


@app.command()
@with_node_options(("model", *(name for name in SHARED if name != "trace"), *DECODER),
                   model=DEFAULT_MODEL, threads=THREADS_PER_NODE)
def demo(
    node_options: NodeOptions,
    ctx: typer.Context,
    decoders: Annotated[int, typer.Option(help="Decoder processes")] = 3,
    prompts_file: Annotated[str | None, typer.Option(
        help="JSON Lines ({'prompt': ...} or {'prompt_token_ids': [...]}, optional "
             "max_tokens) or plain text, one prompt per line")] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens per request at most")] = 32,
    temperature: Annotated[float, typer.Option(help="0 means greedy")] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    trace: Annotated[str | None, typer.Option(
        help="Write one Chrome/Perfetto trace of every process (router, prefiller, decoders) "
             "to this JSON file")] = None,
    prefill_tp: PrefillTpOption = 1, decode_tp: DecodeTpOption = 1,
    decode_dp: Annotated[int, typer.Option(
        help="Data-parallel decoder ranks: that many independent decoder engines, one process "
             "each (overrides --decoders; S9a's DP deployment)")] = 0,
    deployment: Annotated[str | None, typer.Option(
        help="A preset of S9 with its model's architecture at toy size: qwen3-coder "
             "(Qwen3-MoE, TP 4 -> TP 4, HND, 3 decoders) or deepseek-r1 (MLA + MoE, its latent "
             "KV replicated on every rank, TP 4 prefiller, 3 DP decoders)")] = None,
    routing: RoutingOption = ROUTING,
    routing_margin: RoutingMarginOption = LOAD_MARGIN,
) -> None:
    """One prefiller and N decoders as processes over libfabric, with a router and a live view."""
    from rich.live import Live

    from disagg.apps.demo import load_prompts, run_demo
    from disagg.apps.demo_view import metrics_table, request_table, totals_table
    from disagg.apps.deployments import apply_deployment, explicit_fields
    from disagg.apps.progress import StartupProgress
    from disagg.node.cluster_config import ClusterConfig
    from disagg.node.node_config import check_node_memory

    options = {**node_options, "num_decoders": decode_dp or decoders, "prefill_tp": prefill_tp,
               "decode_tp": decode_tp, "routing": routing, "routing_margin": routing_margin}
    if deployment is not None:  # before anything starts: a conflicting flag fails here
        options = apply_deployment(options, deployment, explicit_fields(ctx))
    cluster = ClusterConfig.from_options(**options)
    check_node_memory(cluster.node.device, cluster.node.kv_memory_path)  # here, not per node
    specs = load_prompts(prompts_file)
    names = [name for name, _ in cluster.nodes()]
    if as_json:
        with StartupProgress(expect=names) as progress:
            result = run_demo(cluster, specs, max_tokens, temperature, trace=trace,
                              on_node=progress.on_node)
        sys.stdout.write(json.dumps(result) + "\n")
        _exit_if_failed(result)
        return
    err_console.print(f"starting 1 prefiller and {cluster.num_decoders} decoders "
                      f"({cluster.node.model}, {cluster.node.provider})...")
    live = Live(console=console, refresh_per_second=8)  # started once the nodes are up

    def view(requests: list) -> None:
        if not live.is_started:
            progress.close()
            live.start()
        live.update(request_table(requests, width=console.width))

    with StartupProgress(expect=names) as progress:
        try:
            result = run_demo(cluster, specs, max_tokens, temperature, trace=trace, view=view,
                              on_node=progress.on_node)
        finally:
            live.stop()
    console.print(totals_table(result))
    console.print(metrics_table(result["metrics"]))
    if result["totals"].get("acceptance_rate") is not None:
        t = result["totals"]
        console.print(f"speculative ({node_options['speculative']}, "
                      f"k={node_options['num_draft_tokens']}): "
                      f"{t['accepted_tokens']} of {t['draft_tokens']} drafts accepted "
                      f"({t['acceptance_rate']:.0%})")
    if trace:
        err_console.print(f"trace: {trace} (open it in https://ui.perfetto.dev)")
    _exit_if_failed(result)


def _exit_if_failed(result: dict) -> None:
    """A demo whose requests failed is not a success: exit 1 (the output says which)."""
    failed = result["totals"]["failed"]
    if failed:
        err_console.print(f"[bold red]{failed} of {result['totals']['requests']} requests "
                          "failed[/bold red]", highlight=False)
        raise SystemExit(1)


@app.command()
def plan(
    prefill_tp: Annotated[int, typer.Option(help="Prefiller TP degree")] = 1,
    decode_tp: Annotated[int, typer.Option(help="Decoder TP degree")] = 1,
    kv_layout: LayoutOption = "HND",
    replicated: Annotated[bool, typer.Option(help="Replicated KV on both sides (MLA)")] = False,
    model: Annotated[str, typer.Option(help="A preset (tiny, small) or smollm2-135m or an "
                                            "HF checkpoint; its head counts are used")] = "tiny",
    page_size: PageSizeOption = OPTION_DEFAULTS["page_size"],
    prompt_tokens: Annotated[int, typer.Option(help="Prompt length for the totals")] = 4096,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Writes and bytes per rank pair for one page, and NHD versus HND totals (S6, S7)."""
    from rich.table import Table

    from disagg.apps.plan import plan_report
    from disagg.model.loading.registry import model_config
    from disagg.model.sharding import Sharding

    config = model_config(model)
    report = plan_report(config, Sharding.of_model(config, prefill_tp, replicated),
                         Sharding.of_model(config, decode_tp, replicated),
                         check_kv_layout(kv_layout), page_size, 4, prompt_tokens)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
        return
    table = Table(title=f"one page of one layer, {kv_layout}: prefill TP {prefill_tp} -> "
                        f"decode TP {decode_tp} ({config.num_kv_heads} KV heads)")
    for column in ("src rank", "dst rank", "writes", "bytes"):
        table.add_column(column, justify="right")
    for pair in report["pairs"]:
        table.add_row(str(pair["src_rank"]), str(pair["dst_rank"]), str(pair["writes"]),
                      str(pair["bytes"]))
    console.print(table)
    layouts = Table(title=f"a {prompt_tokens}-token prompt: {report['pages']} pages x "
                          f"{report['num_layers']} layers")
    for column in ("layout", "writes per page", "writes per prompt"):
        layouts.add_column(column, justify="right")
    for layout, numbers in report["layouts"].items():
        layouts.add_row(layout, str(numbers["writes_per_page"]),
                        str(numbers["writes_per_prompt"]))
    console.print(layouts)


def _print_now(text: str) -> None:
    console.print(text, end="", markup=False, highlight=False)
    console.file.flush()  # stream token by token even when stdout is a pipe


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; user errors become one line on stderr and exit code 2."""
    from transfer_core.errors import TransferError

    try:
        app(args=argv, prog_name="disagg")  # not argv[0]'s (`python -m pytest`)
    except (DisaggError, TransferError, ValueError) as error:
        # Escaped: messages quote user text and brackets ('disagg[figures]', '[::1]:7000')
        # that rich would otherwise swallow as markup tags. soft_wrap: one line, not wrapped
        # at the console's width, so scripts can grep it.
        err_console.print(f"[bold red]error:[/bold red] {escape(str(error))}", highlight=False,
                          soft_wrap=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
