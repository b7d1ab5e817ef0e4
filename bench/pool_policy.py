"""Rows pulled a decode token by pools of 25% of the experts, on the CPU (issue 42's chat bar).

    PYTHONSAFEPATH=1 python bench/pool_policy.py [--prompt 256] [--rounds 3] [--tokens 32]

gpu_pull.py's sequence for its "pools 25%, arena all, expertd's loop" case (a long prompt, a
decode, then rounds of: a decode on expertd's loop, the long prompt speculative, the long prompt
waiting per layer), on a model with the H100 bench's router fan-out (12 MoE layers x 128
experts, top-8) but hidden 256, so that it runs on this CPU; the host pull stands in for the
device's, on device-backed pools. Per round: the rows pulled a decode token, what the decode and
the prompts promoted, and the decode's tokens (checked equal to resident mlx-lm's). What the
pools keep between decodes decides the rows a decode token pulls, which is what the chat bar
is short of on the device (bench/RESULTS.md, "GPU: device pulls").
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SPEC = dict(family="qwen3_moe", layers=12, experts=128, top_k=8, hidden=256, moe_inter=128,
            bits=4, mode="affine", seed=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=256, help="the long prompt's tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="tokens a decode")
    args = parser.parse_args()

    import mlx.core as mx
    import mlx_lm
    from common import daemon, ensure_model
    from gpu_pools import decode, first_token, waiting_first_token
    from gpu_pull import mark, read_every_expert, window_counts

    from expertd.client import load
    from expertd.manifest import Manifest

    model_dir, blob_dir = ensure_model("pool-policy-128x8-h256", SPEC)
    m = Manifest.load(blob_dir)
    all_gb = m.total_expert_bytes * 1.3 / 2**30 + 0.01
    pool_gb = 0.25 * sum(la.num_experts * la.expert_bytes for la in m.layers) / 2**30
    resident, tokenizer = mlx_lm.load(str(model_dir))
    vocab = resident.args.vocab_size
    ids = mx.array([[(37 * i + 11) % (vocab - 16) + 8 for i in range(args.prompt)]])
    want = decode(resident, tokenizer, args.tokens, 0.0)["tokens"]
    with daemon(blob_dir, all_gb):
        streamed, _ = load(blob_dir, pool_gb=pool_gb, pull="host", prefetch="off",
                           pool_backing="device")
        session = streamed.expertd_session
        try:
            print(f"pool rows a layer: {session.pools[0].rows}", flush=True)
            read_every_expert(session)
            first_token(streamed, ids)
            decode(streamed, tokenizer, args.tokens, 0.0)
            for r in range(args.rounds):
                before, pools = mark(session), session.pool_counters()
                run = decode(streamed, tokenizer, args.tokens, 0.0, session, True)
                got, own = run["tokens"], run["window"]
                if got != want:
                    raise AssertionError("streamed tokens differ from resident ones")
                window, after = window_counts(session, before), session.pool_counters()
                first_token(streamed, ids)
                waiting_first_token(streamed, ids)
                prompts = session.pool_counters()
                print(f"round {r}: rows pulled a decode token "
                      f"{own['rows_pulled'] / own['tokens']:.2f} (with its prompt's "
                      f"{window['rows_pulled'] / args.tokens:.2f}); promoted by the decode "
                      f"{after['promoted'] - pools['promoted']}, by the two prompts "
                      f"{prompts['promoted'] - after['promoted']}", flush=True)
        finally:
            session.close()


if __name__ == "__main__":
    main()
