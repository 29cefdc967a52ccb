"""Two Ray nodes on this machine, to try a cluster without one: a head (resource `head`) and a "GPU" node (resource
`gpu_node`, standing for the GPU), every listener of both on 127.0.0.1, under Ray's token auth. `ray start` cannot
do this: a second node needs RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, which puts every Ray port on all interfaces.
Prints the cluster's address, then holds both nodes until Ctrl-C or SIGTERM, and stops them. docs/deploy.md uses it:

  .venv/bin/python deploy/one_machine_cluster.py --port 6390 &
  RAY_ADDRESS=127.0.0.1:6390 .venv/bin/ppo-logprobs serve --worker-resources '{"gpu_node": 0.5}' --port 8133
"""

from __future__ import annotations

import argparse
import os
import signal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=6390, help="the head's port (Ray's GCS), on 127.0.0.1")
    parser.add_argument("--cpus", type=int, default=1, help="CPU slots of each node")
    args = parser.parse_args()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # (every listener on loopback: read when Ray is imported)
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # (taken below, by sigwait)
    from ray._private.authentication.authentication_token_setup import ensure_token_if_auth_enabled
    from ray.cluster_utils import Cluster

    # the token (~/.ray/auth_token, or RAY_AUTH_TOKEN): ray.init makes it on a machine that has none, Cluster does not,
    # and its head would then fail on its own first connection
    ensure_token_if_auth_enabled()

    cluster = Cluster(initialize_head=True, head_node_args=dict(gcs_server_port=args.port, num_cpus=args.cpus,
                                                                 resources={"head": 1}, include_dashboard=False))
    try:
        cluster.add_node(num_cpus=args.cpus, resources={"gpu_node": 1})
        print(f"a head and a GPU node at {cluster.address}; Ctrl-C stops them", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
