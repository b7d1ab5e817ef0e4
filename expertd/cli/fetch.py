"""``expertd fetch``: complete a lazy blob directory (``expertd convert --lazy``) ahead of time."""

from pathlib import Path

from expertd.cli import argtypes


def _cmd_fetch(args) -> int:
    from expertd.cli.output import answer
    from expertd.remote import FetchSettings
    from expertd.tools.fetch import fetch_missing
    from expertd.units import size_text

    settings = FetchSettings(connections=args.connections, coalesce=args.coalesce,
                             timeout=args.timeout)
    done = fetch_missing(Path(args.blobs), None if args.all else args.layers,
                         progress=not args.quiet, settings=settings)
    checked = (f"; {done['shards_checked']} shards match their published sha256"
               if done["shards_checked"] else f" ({done['note']})" if done["note"] else "")
    return answer(f"{args.blobs}: fetched {done['rows_fetched']} rows "
                  f"({size_text(done['bytes_fetched'])} in {done['fetch_requests']} requests); "
                  f"{done['rows_present']}/{done['rows_total']} rows present{checked}", 0)


def add_subcommands(sub) -> None:
    p = sub.add_parser("fetch", help="fetch the experts of a lazy blob directory ahead of time",
                       description="Complete a blob directory made by expertd convert --lazy: "
                       "fetch every expert row not there yet by HTTP range (adjacent experts "
                       "coalesced), write it durably and record its checksum, with a progress "
                       "bar. Resumable: an interrupted fetch keeps what arrived. A daemon may "
                       "serve the directory meanwhile. Once a shard has arrived whole, it is "
                       "checked against the sha256 its server published (Hugging Face's LFS "
                       "hash).")
    p.add_argument("--blobs", required=True, help="lazy blob directory")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every MoE layer (the default)")
    which.add_argument("--layers", metavar="A:B",
                       help="only the MoE layers A:B of the directory (a Python slice, "
                       "numbered as in expertd status and its errors)")
    p.add_argument("--connections", type=argtypes.positive_int, default=4,
                   help="parallel range requests")
    p.add_argument("--coalesce", type=argtypes.positive_int, default=4,
                   help="adjacent experts fetched by one range request, at most")
    p.add_argument("--timeout", type=argtypes.seconds, default=30.0,
                   help="seconds a connection may wait for the server before a retry")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_fetch)
