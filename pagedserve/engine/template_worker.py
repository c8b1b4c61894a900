"""The child process that renders chat templates requests bring (run as a script, not
imported: it needs jinja2 and pagedserve's renderer, `pagedserve/chat_template.py`, not
the engine or torch).

Why a process: a template is a program.  Jinja's sandbox keeps it from reaching
Python's internals, but not from multiplying a string to 16 GB or looping for hours;
only a process can be bounded in memory (RLIMIT_AS, set here before the first render)
and stopped at a deadline (the parent kills it).  Whatever a template does, it costs
this process alone, and the parent starts a new one for the next request.

Protocol: one JSON object per line on stdin ({"template", "messages", "tools",
"add_generation_prompt", "continue_final_message", "kwargs", "max_chars", "join_text"}), one per
line on stdout ({"text": ...} or {"error": ...}).
"""

from __future__ import annotations

import json
import os
import resource
import sys


def _address_space_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _render(req: dict) -> str:
    from pagedserve.chat_template import iterates_content, join_text_parts, render_chat_template

    messages = req["messages"]
    if req.get("join_text") and not iterates_content(req["template"]):
        messages = [join_text_parts(m) for m in messages]
    return render_chat_template(req["template"], messages, tools=req.get("tools"),
                                add_generation_prompt=req.get("add_generation_prompt", True),
                                continue_final_message=req.get("continue_final_message", False),
                                **req.get("kwargs", {}))


def main() -> None:
    # The package this file belongs to, whether installed or run from a checkout (-I
    # leaves PYTHONPATH and the working directory out of the path).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from pagedserve.chat_template import render_chat_template

    # Import jinja2 and build the sandboxed environment now, before "ready": the first
    # render paid ~0.1 s for them (Zen 4, AVX-512, native bf16) and seconds on a loaded
    # host with a cold disk cache, out of a request's time limit.
    render_chat_template("{{ messages[0]['content'] }}", [{"role": "user", "content": ""}])
    budget = int(sys.argv[1])
    # The budget is on top of what the interpreter and its imports already map.
    limit = _address_space_now() + budget
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = sys.stdout
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            text = _render(req)
            # Too long: the parent words the refusal (chat_utils.prompt_too_long).
            reply = {"limit": "size", "length": len(text)} if len(text) > req["max_chars"] else {"text": text}
        except MemoryError:
            reply = {"error": f"rendering needed more than {budget >> 20} MiB of memory", "limit": "memory"}
        except RecursionError:
            reply = {"error": "the template recursed too deeply", "limit": "recursion"}
        except Exception as e:  # noqa: BLE001 - a template error is the client's: say what it was
            reply = {"error": f"{type(e).__name__}: {e}"[:1000]}
        print(json.dumps(reply), file=out, flush=True)


if __name__ == "__main__":
    main()
