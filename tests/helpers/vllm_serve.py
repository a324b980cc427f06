"""``dynamo-flexkv serve`` exactly as the CLI runs it, with a longer readiness deadline: the CLI
waits 300 s (dynamo_flexkv.serve.launcher.serve's ready_timeout, not a CLI option), and two vLLM
workers starting on 2 CPU cores shared with other vLLM runs took up to ~300 s here.
``vllm_serve.py READY_TIMEOUT_S serve GRAPH -f CONFIG ...``"""

import sys

from dynamo_flexkv import cli
from dynamo_flexkv.serve import launcher

if __name__ == "__main__":
    timeout, argv = float(sys.argv[1]), sys.argv[2:]
    serve = launcher.serve
    launcher.serve = lambda plan, echo, ready_timeout=timeout, **kw: serve(plan, echo, ready_timeout=timeout, **kw)
    sys.exit(cli.main(argv))
