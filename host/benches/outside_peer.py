"""The Python peer of the `outside` bench (selected with PLUGLET_BENCH_PEER=python).

It speaks the same line protocol as the bench's Rust peer: commands on stdin, answers with
wall-clock timestamps (ns since the epoch) on stdout.

- `dp <resource> <socket> <prefix> <n>`: serve v1beta1.DevicePlugin on <socket> with n devices
  `<prefix>-<k>`, call Register on kubelet.sock; prints `REG <sent> <answered>`.
- `serve <socket> <prefix> <n>`: the same device plugin without calling Register; prints
  `SERVING <t>`.
- `flip <socket>`: flip device 0's health of that plugin and send the full list on its
  ListAndWatch streams; prints `SENT <t>`.
- `csi <socket> <name>`: serve pluginregistration.Registration + csi.v1.Node on <socket>; prints
  `BOUND <name> <t>`, then `NOTIFY <name> <GetInfo received> <Notify received> <registered>`.

Usage: python outside_peer.py <stubs dir> <kubelet.sock>
"""

import os
import sys
import threading
import time
from concurrent import futures

sys.path.insert(0, sys.argv[1])
KUBELET = sys.argv[2]

import grpc  # noqa: E402

import csi_pb2  # noqa: E402
import csi_pb2_grpc  # noqa: E402
import deviceplugin_pb2 as dp  # noqa: E402
import deviceplugin_pb2_grpc as dp_grpc  # noqa: E402
import pluginregistration_pb2 as reg  # noqa: E402
import pluginregistration_pb2_grpc as reg_grpc  # noqa: E402

OUT = threading.Lock()


def say(line):
    with OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def now_ns():
    return time.time_ns()


class Devices(dp_grpc.DevicePluginServicer):
    def __init__(self, prefix, n):
        self.prefix = prefix
        self.n = n
        self.zero_unhealthy = False
        self.version = 0
        self.cond = threading.Condition()
        self.current = self.render()

    def render(self):
        topology = dp.TopologyInfo(nodes=[dp.NUMANode(ID=0)])
        return dp.ListAndWatchResponse(
            devices=[
                dp.Device(
                    ID="%s-%d" % (self.prefix, k),
                    health="Unhealthy" if k == 0 and self.zero_unhealthy else "Healthy",
                    topology=topology,
                )
                for k in range(self.n)
            ]
        )

    def flip(self):
        self.zero_unhealthy = not self.zero_unhealthy
        answer = self.render()
        sent = now_ns()
        with self.cond:
            self.current = answer
            self.version += 1
            self.cond.notify_all()
        return sent

    def GetDevicePluginOptions(self, request, context):
        return dp.DevicePluginOptions()

    def ListAndWatch(self, request, context):
        seen = -1
        while context.is_active():
            with self.cond:
                while self.version == seen and context.is_active():
                    self.cond.wait(0.5)
                if self.version == seen:
                    continue
                seen = self.version
                answer = self.current
            yield answer

    def Allocate(self, request, context):
        responses = []
        for r in request.container_requests:
            ids = list(r.devices_ids)
            responses.append(
                dp.ContainerAllocateResponse(
                    envs={"BENCH_DEVICES": ",".join(ids)},
                    devices=[
                        dp.DeviceSpec(
                            container_path="/dev/bench/" + i,
                            host_path="/dev/null",
                            permissions="rw",
                        )
                        for i in ids
                    ],
                )
            )
        return dp.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request, context):
        return dp.PreStartContainerResponse()


class Csi(reg_grpc.RegistrationServicer, csi_pb2_grpc.NodeServicer):
    def __init__(self, name):
        self.name = name
        self.get_info_at = 0

    def GetInfo(self, request, context):
        self.get_info_at = now_ns()
        return reg.PluginInfo(
            type="CSIPlugin", name=self.name, endpoint="", supported_versions=["1.0.0"]
        )

    def NotifyRegistrationStatus(self, request, context):
        at = now_ns()
        say(
            "NOTIFY %s %d %d %s"
            % (self.name, self.get_info_at, at, "true" if request.plugin_registered else "false")
        )
        return reg.RegistrationStatusResponse()

    def NodeGetInfo(self, request, context):
        return csi_pb2.NodeGetInfoResponse(node_id="bench-node")


def server():
    return grpc.server(futures.ThreadPoolExecutor(max_workers=8))


def serve_devices(servers, socket, prefix, n):
    devices = Devices(prefix, n)
    s = server()
    dp_grpc.add_DevicePluginServicer_to_server(devices, s)
    s.add_insecure_port("unix://" + socket)
    s.start()
    servers.append(s)
    return devices


def main():
    plugins = {}
    servers = []
    kubelet = grpc.insecure_channel("unix://" + os.path.abspath(KUBELET))
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "serve":
            socket, prefix, n = words[1], words[2], int(words[3])
            plugins[socket] = serve_devices(servers, socket, prefix, n)
            say("SERVING %d" % now_ns())
        elif words[0] == "dp":
            resource, socket, prefix, n = words[1], words[2], words[3], int(words[4])
            plugins[socket] = serve_devices(servers, socket, prefix, n)
            stub = dp_grpc.RegistrationStub(kubelet)
            request = dp.RegisterRequest(
                version="v1beta1",
                endpoint=os.path.basename(socket),
                resource_name=resource,
                options=dp.DevicePluginOptions(),
            )
            sent = now_ns()
            stub.Register(request, timeout=30)
            say("REG %d %d" % (sent, now_ns()))
        elif words[0] == "flip":
            say("SENT %d" % plugins[words[1]].flip())
        elif words[0] == "csi":
            socket, name = words[1], words[2]
            service = Csi(name)
            s = server()
            reg_grpc.add_RegistrationServicer_to_server(service, s)
            csi_pb2_grpc.add_NodeServicer_to_server(service, s)
            s.add_insecure_port("unix://" + socket)
            s.start()
            servers.append(s)
            say("BOUND %s %d" % (name, now_ns()))
        else:
            raise SystemExit("peer: unknown command %r" % line)
    os._exit(0)


if __name__ == "__main__":
    main()
