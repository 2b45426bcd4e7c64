"""A handler process written with stock grpcio, as a new-language author would write one from
proto/README.md alone: Python stubs generated from proto/ at start, the Unix socket dialled as
`unix:///path` with no channel options but the message sizes.

Usage: grpcio_handler.py SOCKET_PATH PROTO_DIR

It registers one create handler (`grpcio_create`) for `examples`, answers pings, and answers
the first invocation with a log record (which contains a newline) and a success that labels the
object `grpcio: "yes"`. It prints one line per step (WELCOME, INVOCATION, ACK) and exits 0 after
the result is acknowledged.
"""

import importlib.resources
import os
import queue
import sys
import tempfile

from grpc_tools import protoc


def generate(proto_dir, out_dir):
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    files = sorted(
        os.path.join("capstan", "v1", name)
        for name in os.listdir(os.path.join(proto_dir, "capstan", "v1"))
        if name.endswith(".proto")
    )
    code = protoc.main(
        ["protoc", f"-I{proto_dir}", f"-I{well_known}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
        + files
    )
    if code != 0:
        raise SystemExit(f"protoc failed with {code}")
    sys.path.insert(0, out_dir)


def main():
    socket_path, proto_dir = sys.argv[1], sys.argv[2]
    out_dir = tempfile.mkdtemp(prefix="capstan-stubs-")
    generate(proto_dir, out_dir)

    import grpc
    from capstan.v1 import common_pb2, registration_pb2, runtime_service_pb2 as rs, runtime_service_pb2_grpc as rs_grpc
    from capstan.v1 import invocation_pb2

    sixteen_mib = 16 * 1024 * 1024
    channel = grpc.insecure_channel(
        f"unix://{socket_path}",
        options=[
            ("grpc.max_send_message_length", sixteen_mib),
            ("grpc.max_receive_message_length", sixteen_mib),
        ],
    )
    stub = rs_grpc.RuntimeServiceStub(channel)
    outgoing = queue.Queue()

    def requests():
        while True:
            message = outgoing.get()
            if message is None:
                return
            yield message

    outgoing.put(
        rs.ConnectRequest(
            hello=rs.Hello(
                capabilities=[rs.CAPABILITY_RESULT_ACK],
                sdk=rs.SoftwareInfo(name="grpcio-interop", version=grpc.__version__, language="python"),
                instance_id="grpcio-interop-1",
                handlers=[
                    registration_pb2.HandlerRegistration(
                        handler_id="grpcio_create",
                        kind=registration_pb2.HANDLER_KIND_CREATE,
                        resource=registration_pb2.ResourceSelector(name="examples"),
                    )
                ],
            )
        )
    )
    for response in stub.Connect(requests()):
        which = response.WhichOneof("message")
        if which == "welcome":
            accepted = [s.handler_id for s in response.welcome.registrations if s.accepted]
            print("WELCOME", response.welcome.runtime.name, ",".join(accepted), flush=True)
        elif which == "ping":
            outgoing.put(rs.ConnectRequest(pong=rs.Pong(nonce=response.ping.nonce)))
        elif which == "invocation":
            invocation = response.invocation
            print("INVOCATION", invocation.handler_id, invocation.resource.name, invocation.attempt, flush=True)
            outgoing.put(
                rs.ConnectRequest(
                    log=rs.LogRecord(
                        invocation_id=invocation.invocation_id,
                        level=rs.LOG_LEVEL_INFO,
                        message="handled by grpcio\nFORGED line from a handler process",
                    )
                )
            )
            outgoing.put(
                rs.ConnectRequest(
                    result=invocation_pb2.InvocationResult(
                        invocation_id=invocation.invocation_id,
                        success=invocation_pb2.Success(),
                        patches=[
                            common_pb2.Patch(
                                type=common_pb2.PATCH_TYPE_MERGE,
                                target=common_pb2.PATCH_TARGET_OBJECT,
                                body=common_pb2.Json(json=b'{"metadata":{"labels":{"grpcio":"yes"}}}'),
                            )
                        ],
                    )
                )
            )
        elif which == "result_ack":
            print("ACK", response.result_ack.accepted, flush=True)
            outgoing.put(rs.ConnectRequest(goodbye=rs.Goodbye(reason="done")))
            outgoing.put(None)
            break
    channel.close()


if __name__ == "__main__":
    main()
