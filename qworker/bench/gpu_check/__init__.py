"""One prepared check of the GPU path, for a machine with an NVIDIA GPU (scripts/gpu_check.sh runs
scripts/gpu_check.py, which drives `run.run_check`).

One module per stage, each recorded in OUT/gpu_check.json (`report.py`: rewritten after every
stage, so a kill keeps what finished) and summarized in OUT/gpu_check.md:
  env      versions, device, and that the engine and the bench import without pydantic, redis or boto3
  kernels  every Triton kernel against its plain-torch reference (qworker_kernels.testing)
  bench    (kernel_bench.py) scripts/bench_triton_kernels.py: decode attention bandwidth vs HBM
           peak and vs a device-to-device copy, batch 1/16/64/256 x ctx 512/2048/8192
  parity   a small fp32 random Llama: greedy tokens of transformers, the torch backend, the
           Triton backend eager and with CUDA graphs (padded batches, chunked prefill, preemption)
  e2e      a random Llama with the shape of Llama-3.2-1B: offline-mixed scaled up, through the
           engine with and without CUDA graphs and through transformers static batches; decode
           step times; graphs-vs-eager token agreement in bf16
  cold_start  a worker's time to ready for the 1B-shaped model, by phase, with graph capture;
           a cold start (empty Triton and qworker caches) and a warm one, each a fresh process
  consistency  padded graph replays vs eager, bit for bit, bf16 and fp32, per batch size, with the
           cause (capture, padding of the matmuls' M, split-K count) of any difference
  roofline (roofline_stage.py, roofline.py) decode step at batch 1/8/64/256 x ctx 128/1024 on the
           1B shape against its floor at a copy bandwidth and matmul rate measured in the run;
           the candidate switches (QWORKER_DECODE_SPLITS, QWORKER_KV_WRITE) A/B'd on the same steps
  profile  torch.profiler traces (chrome JSON + key_averages) of one graph-replayed and one eager
           decode step, into OUT/
  serving  nano-vllm's protocol, shared-prefix with caching on and off, logprobs top-5 and n = 4,
           online-poisson with a rising rate, transformers static batches: throughput and
           TTFT/TPOT/ITL percentiles through the bench's run loop
  pytest   (pytest_stage.py) tests/kernels/test_triton_*.py on the GPU, when pytest is installed

Every stage has its own time limit (run.REGISTRY; 300 s in all on the GPU): one that runs out is
recorded as "timed out" with what it measured so far and the next one starts; `--stages` picks a
subset. decode_probe.py builds the synthetic decode steps the roofline, profile and consistency
stages share (one 1B engine for the three).

`sizes.py` holds what differs between the GPU run and the CPU smoke run (`--cpu-smoke`: every
stage with tiny sizes on the CPU under TRITON_INTERPRET=1), `runs.py` the models, systems and runs
(everything measured goes through qworker.bench's run loop and metrics). Only torch, triton,
transformers and numpy are needed: nothing here imports the worker's libraries.
"""
