"""The help text of each engine argument, one line per EngineArgs field: `--help` prints
it (EngineArgs.add_cli_args), so it says what the argument does and what it trades."""

from __future__ import annotations

HELP = {
    "model": "registry name (e.g. smollm2-135m-instruct), HF model directory, or .gguf file",
    "tokenizer": "tokenizer name or path (default: the model's)",
    "dtype": "weight and activation dtype; auto = bfloat16 on a CPU with bf16 instructions, else float32",
    "device": "auto, cpu, cuda or cuda:N",
    "max_model_len": "longest prompt + output in tokens, e.g. 4096, 4k or 4K (default: the model's limit)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (default: 8192; with --no-enable-chunked-prefill at least "
                              "max_model_len)",
    "block_size": "tokens per KV-cache block",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "long_prefill_token_threshold": "cap on one request's prefill chunk per step, with chunked prefill (0 = off)",
    "kv_cache_memory_bytes": "KV cache size in bytes (K, M, G, KiB, MiB, GiB: powers of 1024; k, m, g, kB, MB, GB: of 1000)",
    "kv_cache_memory_ceiling": "without kv_cache_memory_bytes, the KV cache's most bytes in place of the share of "
                               "free memory, still capped at what max_num_seqs x max_model_len can use",
    "gpu_memory_utilization": "CUDA: fraction of the GPU's total memory this engine may use; the KV cache gets "
                              "what the weights and the profiled peak activations leave of it (never more than "
                              "is free), when kv_cache_memory_bytes is unset",
    "prefix_caching_algo": "hash (whole blocks by their chained hash, vLLM's) or radix (SGLang's radix tree: "
                           "then token by token, the matching part of the next block copied from a cached one)",
    "kv_offload_dir": "directory of a KV tier under the block pool that outlives the process: computed prefix "
                      "blocks are written there in the background and loaded instead of recomputed, after "
                      "eviction or a restart (bounded by --kv-offload-bytes, default 8 GiB)",
    "kv_offload_bytes": "size of the KV tier: of --kv-offload-dir, or without it, of a tier in host memory "
                        "(K, M, G, KiB, MiB, GiB: powers of 1024; k, m, g, kB, MB, GB: of 1000)",
    "preemption_mode": "recompute (free a preempted request's KV and recompute it) or swap (copy it to the KV "
                       "tier, host memory of 4 GiB unless --kv-offload-* say otherwise, and load it back)",
    "num_gpu_blocks_override": "exact number of KV-cache blocks (testing)",
    "seed": "random seed of the engine (sampling without a per-request seed)",
    "max_logprobs": "most top logprobs one request may ask for",
    "max_n": "most sequences (n) one request may ask for",
    "generation_config": "auto: sampling defaults from the model's generation_config.json; vllm: built-in defaults; "
                         "a directory: the generation_config.json in it",
    "override_generation_config": "sampling defaults over the generation config's, as a JSON object, e.g. "
                                  "'{\"temperature\": 0.5, \"max_new_tokens\": 256}' (keys: temperature, top_p, "
                                  "top_k, min_p, repetition_penalty, max_new_tokens: on the server it caps every "
                                  "answer as vLLM's does, for generate and chat it is --max-tokens' default; with "
                                  "generation_config vllm: the only defaults)",
    "load_format": "auto, safetensors, gguf or dummy (random weights from the config)",
    "enforce_eager": "never compile or capture graphs (where the model compiles by default, mixture-of-experts "
                     "ones for instance, its 16-bit answers may then break near-ties differently)",
    "torch_compile": "compile the model with torch.compile (default: on for CPU with one process, unless "
                     "--enforce-eager or every decoder layer runs as direct calls to fused C++ kernels: Llama-family "
                     "and Gemma 3 models, LoRA or not; in 16-bit dtypes a compiled graph may break near-ties "
                     "differently; PAGEDSERVE_TORCH_COMPILE=0/1 sets the default)",
    "tensor_parallel_size": "number of processes (GPUs, or CPU ranks over gloo) to shard the model over",
    "data_parallel_size": "engine replicas, each a Ray actor with a whole engine (its own scheduler, KV cache and "
                          "tensor-parallel group), behind one router; 1 needs no Ray",
    "ray_address": "Ray cluster the replicas join: auto (the one `ray start` began on this node) or HOST:PORT of "
                   "its head (default: start a local Ray with the resources the replicas need)",
    "cpus_per_replica": "CPU cores each replica reserves in Ray and runs its threads on (default: this "
                        "machine's cores / data_parallel_size, at least 1)",
    "router_policy": "how a replica is picked: cache_aware (the replica holding the longest prefix of the "
                     "prompt, unless loads are imbalanced), least_loaded (waiting x 4 + running) or round_robin "
                     "(default: cache_aware)",
    "router_cache_threshold": "cache_aware: smallest fraction of the prompt a replica's prefix match must cover "
                              "to win; below it the least loaded replica gets the request (default: 0.5)",
    "router_balance_abs_threshold": "cache_aware: loads count as imbalanced, and the least loaded replica gets "
                                    "the request whatever the others cache, when the busiest replica's load "
                                    "(waiting x 4 + running) exceeds the idlest's by more than this and by more "
                                    "than router_balance_rel_threshold times (default: 32)",
    "router_balance_rel_threshold": "cache_aware: the relative half of the imbalance test above (default: 1.5)",
    "chat_template": "Jinja chat template, or a path to a file holding one",
    "attention_backend": "attention implementation (default: the best for the device)",
    "exact_prompt_attention": "attend every prompt token as a one-token decode step would (cpu_paged's decode "
                              "kernel; torch_paged has none), so answers do not depend on chunking, batching or "
                              "prefix-cache hits; --no-exact-prompt-attention: the blocked prefill paths (SDPA, "
                              "oneDNN), whose rounding can change answers (slower on the CPUs measured)",
    "enable_chunked_prefill": "split long prompts over several steps",
    "scheduling_policy": "fcfs or priority",
    "trust_remote_code": "allow custom code from the model directory",
    "structured_outputs_backend": "grammar library for structured outputs and tool calls: auto (= guidance), "
                                  "guidance (llguidance) or xgrammar",
    "quantization": "weight-only quantization on CPU: auto (a GGUF's quantized tensors stay quantized; "
                    "float checkpoints stay float), none (dequantize a GGUF), gguf, or int8 / int4 "
                    "(quantize a float checkpoint's linear layers at load, groups of 32)",
    "quant_activation_bits": "bits a quantized layer rounds its activations to, per block of 32: 16 keeps "
                             "the dequantized model's answers; 8 (llama.cpp's scheme) is faster on long "
                             "prompts and changes small models' answers",
    "prepack_weights": "keep a oneDNN-packed second copy of each 16-bit linear weight on CPU (faster "
                       "matmuls, twice the memory of those weights; quantized layers never have one)",
    "max_step_ms": "target duration of one step in ms: the token budget shrinks to what the measured "
                   "per-token cost fits in it, so running streams keep decoding while long prompts prefill "
                   "in chunks, while some request streams output; 0 turns it off (default: 250 on CPU, "
                   "off on CUDA)",
    "async_scheduling": "overlap scheduling: prepare step N+1 while step N runs on the device "
                        "(default: on for CUDA, off on CPU)",
    "kv_cache_dtype": "what the KV cache stores: auto (the model's dtype), bfloat16 or float16 (half of float32's "
                      "bytes), int8 (a scale per token and head, llama.cpp's q8_0 idea: 3.9x fewer bytes than "
                      "float32), fp8 / fp8_e4m3 or fp8_e5m2 (a per-tensor scale of 1, as vLLM without calibrated "
                      "scales; on a small model int8 keeps answers closer); attention computes in the model's dtype",
    "runner": "generate (text: completions, chat, responses, messages) or pooling (one vector or score per "
              "prompt: /v1/embeddings, /v1/score, /v1/rerank, LLM.embed and LLM.score)",
    "pooler_config": "the pooling runner's pooler as a JSON object, e.g. '{\"pooling_type\": \"MEAN\"}' "
                     "(fields: pooling_type LAST, MEAN or CLS, default LAST; normalize, default true; "
                     "classifier_from_token, e.g. [\"no\", \"yes\"]: score pairs with those two tokens' "
                     "logits, as Qwen3-Reranker; without it scores are embedding cosine similarities)",
    "enable_lora": "serve LoRA adapters (PEFT directories) picked per request: LLM.generate(lora_request=...), "
                   "the server's --lora-modules and the request's model field",
    "max_loras": "LoRA adapters resident in the model at once (at most this many distinct adapters run in one step)",
    "max_lora_rank": "the largest LoRA rank an adapter may have",
    "max_cpu_loras": "LoRA adapters kept loaded in host memory, least recently used dropped first "
                     "(default: max_loras)",
    "limit_mm_per_prompt": "most images one prompt may carry, as JSON '{\"image\": 4}' (default: 8)",
    "allowed_media_domains": "comma-separated domains whose http(s) image URLs the server may fetch (never "
                             "loopback or private addresses; default: none, images come as data: URLs)",
    "disable_chunked_mm_input": "never split an image's tokens across prefill chunks (always on for models "
                                "whose image tokens attend both ways, Gemma 3)",
    "encoder_cache_size": "room for vision-encoder outputs, in embedding rows, also what one step may encode "
                          "(default: max_num_batched_tokens, at least 8192)",
    "speculative_config": "speculative decoding as a JSON object, e.g. "
                          "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (fields: method, "
                          "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, disable_by_batch_size; or "
                          "'{\"model\": \"DRAFT\", \"num_speculative_tokens\": 4}' for a draft model); "
                          "'off' for none.  Default: n-gram drafts on CPU (exact; off at large batches), none on CUDA",
}
