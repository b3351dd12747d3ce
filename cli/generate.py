"""`baton generate`: a streaming client that prints text as it arrives, then the finish
reason, usage and timings on stderr. Also the smallest example of calling Baton."""

from __future__ import annotations

import os
import sys

import grpc

from baton.services.rpc.convert import finish_reason_of, sampling_message
from baton.services.rpc.security import client_credentials
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running Baton")
    p.add_argument("prompt")
    p.add_argument("--address", default=os.environ.get("BATON_ROUTER", "localhost:50051"))
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    p.add_argument("--api-key", default=os.environ.get("BATON_API_KEY"),
                   help="sent as `authorization: Bearer <key>`")
    p.add_argument("--tls-ca", help="TLS: the CA that signed the router's certificate")


def request_of(args) -> gen.GenerateRequest:
    sampling = sampling_message(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=args.stop)
    if args.chat:
        chat = gen.ChatMessages(messages=[gen.ChatMessage(role="user", content=args.prompt)])
        return gen.GenerateRequest(chat=chat, sampling=sampling)
    return gen.GenerateRequest(text=args.prompt, sampling=sampling)


def generate(args) -> None:
    creds = client_credentials(args.tls_ca)
    channel = (grpc.secure_channel(args.address, creds) if creds is not None
               else grpc.insecure_channel(args.address))
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    with channel:
        stub = gen_grpc.GenerationStub(channel)
        try:
            for msg in stub.Generate(request_of(args), timeout=args.timeout,
                                     metadata=metadata):
                sys.stdout.write(msg.delta.text)
                sys.stdout.flush()
                if msg.delta.finish_reason:
                    u, t = msg.usage, msg.timings
                    print(flush=True)
                    reason = finish_reason_of(msg.delta.finish_reason)
                    print(f"[{reason}] prompt {u.prompt_tokens}, "
                          f"completion {u.completion_tokens}, cached {u.cached_tokens} "
                          f"tokens; first token {t.first_token_s * 1000:.0f} ms, KV "
                          f"transfer {t.kv_transfer_s * 1000:.1f} ms", file=sys.stderr)
        except grpc.RpcError as e:
            sys.exit(f"\nerror: {e.code().name}: {e.details()}")
