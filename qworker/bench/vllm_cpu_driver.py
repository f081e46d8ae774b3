"""The process that runs vLLM's CPU build for the `vllm-cpu` bench system (qworker/bench/vllm_cpu.py).

It runs under the Python of vLLM's own virtual environment, executed by path, so it imports only
the standard library and vllm: nothing of qworker, which is not installed there. It drives
`vllm.LLM`'s engine exactly as `LLM.generate` does (add requests, then `llm_engine.step()` until
none is unfinished), except that requests may be added between steps as they arrive.

Protocol, one JSON object per line. Standard output is kept for it alone (everything vLLM prints
goes to standard error):
- out: {"event": "ready", "startup_s", "vllm_version", "env"} once the model is loaded, or
  {"event": "error", "message"} if it cannot be.
- in:  {"op": "add", "id", "prompt_token_ids", "max_tokens", "temperature", "ignore_eos", "seed"}
       {"op": "abort", "id"}   {"op": "exit"}
- out: {"event": "step", "t", "outputs": [[id, new_token_ids, finished], ...]} after each engine
  step that produced output; {"event": "rejected", "id", "message"} for a request vLLM refuses.
  `t` is time.perf_counter() right after the step returned: CLOCK_MONOTONIC, the same clock in
  every process of the machine, so the bench converts it to its run's clock as it is.

    python vllm_cpu_driver.py '{"model": DIR, "dtype": "bfloat16", "max_model_len": 2048, ...}'
"""

import json
import os
import select
import sys
import time


def _open_protocol_channel():
    # vLLM logs to standard output: keep a private copy of fd 1 for the protocol and point fd 1
    # at standard error, before vllm is imported (its engine-core process inherits fd 1 too).
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def _send(channel, message):
    channel.write(json.dumps(message, separators=(",", ":")) + "\n")
    channel.flush()


def _read_commands(stdin_fd, buffer, block):
    """Complete lines from stdin: all that are there now, or (block) at least one."""
    lines = []
    timeout = None if block else 0
    while True:
        ready, _, _ = select.select([stdin_fd], [], [], timeout)
        if not ready:
            return lines, buffer, False
        data = os.read(stdin_fd, 1 << 20)
        if not data:
            return lines, buffer, True
        buffer += data
        *complete, buffer = buffer.split(b"\n")
        lines.extend(json.loads(line) for line in complete if line.strip())
        if lines:
            timeout = 0  # take what else is there now, then go


def main():
    channel = _open_protocol_channel()
    settings = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        llm = LLM(
            model=settings["model"],
            dtype=settings["dtype"],
            max_model_len=settings["max_model_len"],
            seed=0,
            **settings.get("engine_options", {}),
        )
    except Exception as exc:
        _send(channel, {"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    engine = llm.llm_engine
    env_keys = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")
    _send(
        channel,
        {
            "event": "ready",
            "startup_s": time.perf_counter() - t0,
            "vllm_version": getattr(vllm, "__version__", None),
            "env": {key: os.environ.get(key) for key in env_keys},
        },
    )

    stdin_fd = sys.stdin.fileno()
    buffer = b""
    unfinished = set()
    while True:
        commands, buffer, is_closed = _read_commands(stdin_fd, buffer, block=not unfinished)
        for command in commands:
            op = command["op"]
            if op == "exit":
                return 0
            if op == "abort":
                if command["id"] in unfinished:
                    unfinished.discard(command["id"])
                    engine.abort_request([command["id"]])
                continue
            assert op == "add", f"unknown op {op!r}"
            params = SamplingParams(
                temperature=command["temperature"],
                max_tokens=command["max_tokens"],
                ignore_eos=command["ignore_eos"],
                seed=command.get("seed"),
                output_kind=RequestOutputKind.DELTA,
            )
            try:
                engine.add_request(
                    command["id"], TokensPrompt(prompt_token_ids=command["prompt_token_ids"]), params
                )
            except ValueError as exc:
                _send(channel, {"event": "rejected", "id": command["id"], "message": str(exc)})
                continue
            unfinished.add(command["id"])
        if is_closed:
            return 0
        if not unfinished:
            continue
        if not engine.has_unfinished_requests():
            # Dropped inside vLLM without an output: stepping on would wait forever.
            for request_id in sorted(unfinished):
                _send(channel, {"event": "rejected", "id": request_id, "message": "dropped by vLLM"})
            unfinished.clear()
            continue
        step_outputs = engine.step()
        t = time.perf_counter()
        outputs = []
        for out in step_outputs:
            if out.request_id not in unfinished:
                continue  # aborted meanwhile
            token_ids = list(out.outputs[0].token_ids) if out.outputs else []
            outputs.append([out.request_id, token_ids, bool(out.finished)])
            if out.finished:
                unfinished.discard(out.request_id)
        if outputs:
            _send(channel, {"event": "step", "t": t, "outputs": outputs})


if __name__ == "__main__":
    sys.exit(main())
