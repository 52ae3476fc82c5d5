"""Load generator for a running DeepInfer (or any OpenAI-compatible) server: throughput and TTFT / TPOT / ITL /
end-to-end latency percentiles. Same as `deepinfer bench serve`; see deepinfer/serve/bench.py for the options.

    deepinfer-serve --model-path /path/to/checkpoint &
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 20 \
        --input-len 256 --output-len 128
"""

import sys

from deepinfer.serve.bench import main

if __name__ == "__main__":
    sys.exit(main())
