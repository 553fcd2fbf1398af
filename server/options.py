"""Command-line options of `vkengine serve`."""


def add_serve_args(p) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--parallel", "-np", type=int, default=4, help="concurrent sequences")
    p.add_argument("--mode", choices=["batch", "slices"], default="batch")
    p.add_argument("--quantum", type=int, default=8, help="tokens per turn in slices mode")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--cors", default=None, help="allowed CORS origin (off unless given)")
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=4096, help="upper bound of n_predict/max_tokens")
    p.add_argument("--max-body", type=int, default=1 << 20, help="request body limit in bytes")
