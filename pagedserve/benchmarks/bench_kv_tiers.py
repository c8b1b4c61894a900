"""The KV tier: first token after a restart on the same --kv-offload-dir, and swap
against recompute preemption.

    python -m pagedserve.benchmarks.bench_kv_tiers [--model M] [--system-tokens 2000]

1. restart: an engine on an empty directory answers a request with a long system
   prompt (its first token's time is the cold figure); a second engine on the same
   directory answers the same system prompt with another question (loaded from disk);
   a third request on that engine hits the pool.  Each engine answers one warm-up
   prompt first, so no figure includes first-call costs.
2. preemption: 16 requests of 600 prompt tokens and 128 new tokens in a KV cache of
   160 blocks (four prompts fit, not their answers), recompute vs swap (host-memory
   tier), prefix caching off: wall time, tokens computed, preemptions.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from pagedserve.cpu_info import describe_cpu
from pagedserve.engine.arg_utils import DEFAULT_MODEL
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams


def system_prompt(num_facts: int) -> str:
    return "You are a careful assistant for a travel agency. " + " ".join(
        f"Fact {i}: the train from city {i} to city {i + 1} leaves at {6 + i % 12}:{i % 6}0 from platform {i % 9 + 1}."
        for i in range(num_facts))


def first_token_seconds(llm: LLM, system: str, question: str) -> float:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    t0 = time.perf_counter()
    llm.chat([messages], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t0


def warm(llm: LLM) -> None:
    llm.generate("Warm up with a short prompt.", SamplingParams(max_tokens=4), use_tqdm=False)


def restart(model: str, facts: int) -> None:
    system = system_prompt(facts)
    with tempfile.TemporaryDirectory() as d:
        llm = LLM(model, kv_offload_dir=d, max_model_len=4096, max_num_seqs=4)
        n = len(llm.get_tokenizer()(system)["input_ids"])
        warm(llm)
        cold = first_token_seconds(llm, system, "When does the train from city 3 leave?")
        llm.llm_engine.shutdown()
        del llm
        llm = LLM(model, kv_offload_dir=d, max_model_len=4096, max_num_seqs=4)
        warm(llm)
        disk = first_token_seconds(llm, system, "Which platform does the train from city 7 use?")
        pool = first_token_seconds(llm, system, "When does the train from city 9 leave?")
        loaded = llm.llm_engine.get_stats().external_prefix_cache_hits
        llm.llm_engine.shutdown()
    print(f"restart, system prompt of {n} tokens: first token cold {cold * 1000:.0f} ms; after a restart, "
          f"from disk {disk * 1000:.0f} ms ({cold / disk:.1f}x sooner, {loaded} tokens loaded); "
          f"from the pool {pool * 1000:.0f} ms ({cold / pool:.1f}x)")


def preemption(model: str) -> None:
    llm = LLM(model, max_model_len=1024)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok(system_prompt(30 + i))["input_ids"][:600]} for i in range(16)]
    del llm
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    outputs = {}
    for mode in ("recompute", "swap"):
        # 160 blocks of 16 tokens: four prompts (38 blocks each) are admitted, and as
        # they decode towards 46 blocks each some are preempted.
        llm = LLM(model, max_model_len=1024, enable_prefix_caching=False, preemption_mode=mode,
                  num_gpu_blocks_override=161)
        warm(llm)
        engine = llm.llm_engine
        computed = [0]
        execute = engine.model_executor.execute_model

        def counting(so, execute=execute, computed=computed):
            computed[0] += so.total_num_scheduled_tokens
            return execute(so)

        engine.model_executor.execute_model = counting
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        outputs[mode] = [o.outputs[0].token_ids for o in outs]
        print(f"preemption {mode:<9}: {wall:6.2f} s, {computed[0]} tokens computed, "
              f"{engine.get_stats().num_preemptions} preemptions")
        engine.shutdown()
        del llm
    print(f"same outputs: {outputs['recompute'] == outputs['swap']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--facts", type=int, default=70, help="system prompt size (70: about 2,000 tokens)")
    ap.add_argument("--parts", nargs="+", default=["restart", "preemption"], choices=["restart", "preemption"])
    args = ap.parse_args()
    print(f"model {args.model}; CPU: {describe_cpu()}")
    if "restart" in args.parts:
        restart(args.model, args.facts)
    if "preemption" in args.parts:
        preemption(args.model)


if __name__ == "__main__":
    main()
