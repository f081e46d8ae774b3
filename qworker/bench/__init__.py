"""`qworker bench`: workloads, the one run loop, the systems under test (qworker's engine and queue,
Hugging Face generate, vLLM's CPU build, the gateway over HTTP), metrics in vLLM's `bench serve`
names, and reports. Sits at the top with the CLI: may import everything below it.
"""
