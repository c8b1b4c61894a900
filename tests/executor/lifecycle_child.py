"""Run by test_lifecycle.py in a fresh interpreter: an engine interrupted by Ctrl-C,
then a second engine left for interpreter exit to shut down."""

from __future__ import annotations

import signal
import sys

from pagedserve import LLM, SamplingParams

if __name__ == "__main__":
    # Ctrl-C raises KeyboardInterrupt even where the suite runs with SIGINT ignored (a
    # background job, nohup), which the child would inherit and wait on forever.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    path = sys.argv[1]
    args = dict(dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
    prompts = [[i + 3] * 16 for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    llm = LLM(path, **args)
    print("PIDS", *llm.llm_engine.model_executor.worker_pids, flush=True)
    engine, step, calls = llm.llm_engine, llm.llm_engine.step, [0, 0]

    def step_and_say_so():  # the parent interrupts once it reads that a generate() is under way
        calls[1] += 1
        if calls[1] == 3:
            print("STEPPING", calls[0], flush=True)
        return step()

    engine.step = step_and_say_so
    try:
        while True:
            calls[:] = [calls[0] + 1, 0]
            llm.generate(prompts, params, use_tqdm=False)
            print("GENERATED", flush=True)
    except KeyboardInterrupt:
        # Mid-step (the usual case) the executor has shut itself down already: the ranks
        # were left out of step.  Between steps it still works; shutdown() is idempotent.
        print("INTERRUPTED", flush=True)
        llm.shutdown()
    llm2 = LLM(path, **args)
    print("PIDS2", *llm2.llm_engine.model_executor.worker_pids, flush=True)
    out = llm2.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    print("DONE", len(out[0].outputs[0].token_ids), flush=True)
    # no shutdown(): the executor's atexit hook stops the worker
