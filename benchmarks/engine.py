"""Single-node engine speed against Hugging Face transformers, side by side in one run (S1).

Same weights (SmolLM2-135M by default, fp32, CPU), same thread count. Measures prefill tokens/s
for one prompt and the time of one decode step at batch sizes 1 and 8, for our paged engine (both
KV layouts) and for transformers' own KV-cached forward. Prints a table; `--json` prints one
object. Run: `python benchmarks/engine.py [--model smollm2-135m] [--prompt-len 512] [--threads 2]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from disagg.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import LoadedModel, load_model


def wait_for_quiet(max_wait_s: float = 30.0, busy_limit: float = 0.15) -> bool:
    """Wait until the machine is mostly idle (other processes skew CPU timings)."""
    def busy() -> float:
        def read() -> tuple[int, int]:
            with open("/proc/stat") as stat:
                fields = [int(x) for x in stat.readline().split()[1:]]
            return sum(fields), fields[3] + fields[4]
        total0, idle0 = read()
        time.sleep(1.0)
        total1, idle1 = read()
        return 1 - (idle1 - idle0) / max(total1 - total0, 1)
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        if busy() < busy_limit:
            return True
    return False


def ours(loaded: LoadedModel, kv_layout: str, prompt: list[int], batch: int, steps: int
         ) -> tuple[float, float]:
    """(prefill seconds for one prompt, seconds per decode step at `batch` requests)."""
    config = EngineConfig(loaded.config,
                          CacheConfig(page_size=16, num_pages=(len(prompt) + steps + 32) // 16
                                      * batch + 64, kv_layout=kv_layout),
                          SchedulerConfig(chunk_size=len(prompt),
                                          max_num_batched_tokens=len(prompt), max_num_seqs=batch))
    engine = build_engine(config, loaded.state_dict)
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    engine.step()  # the whole prompt in one chunk, first token sampled
    prefill = time.perf_counter() - start
    for _ in range(batch - 1):
        engine.add_request(prompt, params)
        engine.step()
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    return prefill, statistics.median(step_times)


def reference(hf_model: torch.nn.Module, prompt: list[int], batch: int, steps: int
              ) -> tuple[float, float]:
    """The same measurement with transformers' forward and DynamicCache."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        out = hf_model(ids, use_cache=True)
        out.logits[:, -1].argmax(-1)
        prefill = time.perf_counter() - start
        out = hf_model(ids.repeat(batch, 1), use_cache=True)
        cache, next_ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
        step_times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = hf_model(next_ids, past_key_values=cache, use_cache=True)
            next_ids = out.logits[:, -1:].argmax(-1)
            step_times.append(time.perf_counter() - start)
            cache = out.past_key_values
    return prefill, statistics.median(step_times)


def hf_model_from(loaded: LoadedModel) -> torch.nn.Module:
    """A transformers LlamaForCausalLM holding exactly our weights."""
    import transformers

    c = loaded.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    state = {("" if name == "lm_head.weight" else "model.") + name: t
             for name, t in loaded.state_dict.items()}
    model.load_state_dict(state, strict=False)
    if c.tie_word_embeddings:
        model.tie_weights()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    hf_model = hf_model_from(loaded)
    prompt = torch.randint(10, loaded.config.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    quiet = wait_for_quiet()
    runs = {"ours-NHD": lambda b: ours(loaded, "NHD", prompt, b, args.steps),
            "ours-HND": lambda b: ours(loaded, "HND", prompt, b, args.steps),
            "transformers": lambda b: reference(hf_model, prompt, b, args.steps)}
    rows = []
    for name, run in runs.items():
        for batch in (1, 8):
            samples = [run(batch) for _ in range(args.reps)]
            prefill = statistics.median(s[0] for s in samples)
            decode = statistics.median(s[1] for s in samples)
            rows.append({"engine": name, "batch": batch,
                         "prefill_tokens_per_s": args.prompt_len / prefill,
                         "decode_step_ms": decode * 1e3})
    ref = {r["batch"]: r for r in rows if r["engine"] == "transformers"}
    for r in rows:
        r["prefill_speedup"] = r["prefill_tokens_per_s"] / ref[r["batch"]]["prefill_tokens_per_s"]
        r["decode_speedup"] = ref[r["batch"]]["decode_step_ms"] / r["decode_step_ms"]
    result = {"model": args.model, "prompt_len": args.prompt_len, "threads": args.threads,
              "torch": torch.__version__, "quiet_machine": quiet, "rows": rows}
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.model}, prompt {args.prompt_len}, {args.threads} threads"
                        f"{'' if quiet else ' (machine busy: numbers noisy)'}")
    for column in ("engine", "batch", "prefill tok/s", "decode step ms", "prefill x", "decode x"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["engine"], str(r["batch"]), f"{r['prefill_tokens_per_s']:.0f}",
                      f"{r['decode_step_ms']:.2f}", f"{r['prefill_speedup']:.2f}",
                      f"{r['decode_speedup']:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
