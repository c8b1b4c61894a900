"""Prompt tokens reused from the prefix cache: the hash chain against the radix tree.

    python -m pagedserve.benchmarks.prefix_reuse [--model M] [--turns 6] [--conversations 4]

Two workloads, each run with prefix_caching_algo="hash" and "radix" on the same
model, greedy:
- shared-prefix: 32 questions sharing a ~400-token system message, 64 new tokens;
- multi-turn chat: `--conversations` chats of `--turns` turns, run turn by turn;
  each turn's prompt is the chat so far (the previous prompt, the model's answer,
  and a new user message) through the chat template, 48 new tokens, EOS honoured.
  The transcript is made once (by a third engine) and replayed by both, so both see
  the same prompts.
Prints, per workload and algorithm, the prompt tokens, the tokens found in the
prefix cache (prefix_cache_hits) and wall time (after a warm-up), and whether both
gave the same text (reused KV was computed in other batches, so greedy near-ties may
break differently).
"""

from __future__ import annotations

import argparse
import time

from pagedserve.benchmarks.workloads import CHAT_BURST_MESSAGES, shared_prefix
from pagedserve.cpu_info import describe_cpu
from pagedserve.engine.arg_utils import DEFAULT_MODEL
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams

FOLLOW_UPS = ["Tell me more.", "Can you give an example?", "Why is that?", "Say it in one sentence.",
              "What else should I know?", "Thanks! One more detail, please."]


def run_shared_prefix(llm: LLM) -> tuple[int, int, list[str], float]:
    w = shared_prefix()
    params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens[0], ignore_eos=True)
    engine = llm.llm_engine
    before = engine.get_stats()
    t0 = time.perf_counter()
    outs = llm.chat(w.conversations, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = engine.get_stats()
    return (after.prefix_cache_queries - before.prefix_cache_queries,
            after.prefix_cache_hits - before.prefix_cache_hits, [o.outputs[0].text for o in outs], wall)


def multi_turn_transcript(llm: LLM, conversations: int, turns: int) -> list[list[list[dict[str, str]]]]:
    """Each turn's chats (the chat so far: earlier turns with the model's answers, and
    the new user message), as this engine answers them."""
    params = SamplingParams(temperature=0.0, max_tokens=48)
    chats = [[{"role": "user", "content": CHAT_BURST_MESSAGES[i % len(CHAT_BURST_MESSAGES)]}]
             for i in range(conversations)]
    out = []
    for turn in range(turns):
        out.append([list(c) for c in chats])
        answers = llm.chat(chats, params, use_tqdm=False)
        for i, (chat, answer) in enumerate(zip(chats, answers, strict=True)):
            chat.append({"role": "assistant", "content": answer.outputs[0].text})
            chat.append({"role": "user", "content": FOLLOW_UPS[(turn + i) % len(FOLLOW_UPS)]})
    return out


def replay_multi_turn(llm: LLM, transcript: list[list[list[dict[str, str]]]]) -> tuple[int, int, list[str], float]:
    """The transcript's turns in order, so both algorithms see the same prompts; each
    turn's answers are computed (and cached) as a chat server would."""
    params = SamplingParams(temperature=0.0, max_tokens=48)
    engine = llm.llm_engine
    before = engine.get_stats()
    texts = []
    t0 = time.perf_counter()
    for chats in transcript:
        texts += [o.outputs[0].text for o in llm.chat(chats, params, use_tqdm=False)]
    wall = time.perf_counter() - t0
    after = engine.get_stats()
    return (after.prefix_cache_queries - before.prefix_cache_queries,
            after.prefix_cache_hits - before.prefix_cache_hits, texts, wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    args = ap.parse_args()
    print(f"model {args.model}; CPU: {describe_cpu()}")
    engine_kw = dict(max_model_len=4096, max_num_seqs=32)
    ref = LLM(args.model, **engine_kw)
    transcript = multi_turn_transcript(ref, args.conversations, args.turns)
    ref.llm_engine.shutdown()
    del ref
    results: dict[str, dict[str, tuple[int, int, list[str], float]]] = {}
    for algo in ("hash", "radix"):
        llm = LLM(args.model, prefix_caching_algo=algo, **engine_kw)
        llm.generate("Warm up: one short prompt before timing.", SamplingParams(max_tokens=8), use_tqdm=False)
        results[algo] = {"shared-prefix": run_shared_prefix(llm),
                         f"multi-turn ({args.conversations} chats x {args.turns} turns)":
                             replay_multi_turn(llm, transcript)}
        llm.llm_engine.shutdown()
        del llm
    print(f"{'workload':<34} {'algo':<6} {'prompt tokens':>13} {'reused':>8} {'reused %':>9} {'wall s':>7}")
    for name in results["hash"]:
        for algo in ("hash", "radix"):
            queries, hits, _, wall = results[algo][name]
            print(f"{name:<34} {algo:<6} {queries:>13} {hits:>8} {100 * hits / max(queries, 1):>8.1f}% {wall:>7.2f}")
        same = results["hash"][name][2] == results["radix"][name][2]
        print(f"{'':<34} same outputs: {same}")


if __name__ == "__main__":
    main()
