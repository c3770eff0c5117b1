//! The floors: what a row cannot avoid (a peer round trip, a peer `Allocate`, an `fdatasync`,
//! a bare ListAndWatch receiver), measured afresh every iteration.

use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
use pluglet_uds::Channel;

use crate::TIMEOUT;

pub fn ns_between(from: u64, to: u64) -> Duration {
    Duration::from_nanos(to.saturating_sub(from))
}

/// A file for the fsync floor: 64 bytes (or `size`) rewritten in place, then `fdatasync`.
pub struct SyncFloor {
    pub file: File,
    pub data: Vec<u8>,
}

impl SyncFloor {
    pub fn new(dir: &Path, size: usize) -> SyncFloor {
        let file = File::options()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(dir.join(format!(".bench-floor-{size}")))
            .expect("floor file");
        SyncFloor {
            file,
            data: vec![b'x'; size],
        }
    }

    pub fn sample(&mut self) -> Duration {
        self.data[0] = self.data[0].wrapping_add(1);
        let t = Instant::now();
        self.file.write_all_at(&self.data, 0).expect("floor write");
        self.file.sync_data().expect("fdatasync");
        t.elapsed()
    }
}

pub fn peer_rt(rt: &tokio::runtime::Runtime, client: &mut DevicePluginClient<Channel>) -> Duration {
    let t = Instant::now();
    rt.block_on(client.get_device_plugin_options(v1beta1::Empty {}))
        .expect("GetDevicePluginOptions");
    t.elapsed()
}

pub fn peer_allocate(
    rt: &tokio::runtime::Runtime,
    client: &mut DevicePluginClient<Channel>,
    ids: &[String],
) -> Duration {
    let t = Instant::now();
    rt.block_on(client.allocate(v1beta1::AllocateRequest {
        container_requests: vec![v1beta1::ContainerAllocateRequest {
            devices_ids: ids.to_vec(),
        }],
    }))
    .expect("peer Allocate");
    t.elapsed()
}

/// A ListAndWatch codec that reads nothing of a message but its length: the floor's bare
/// receiver, which has an update once its last byte is in.
#[derive(Clone, Copy, Default)]
pub struct LengthOnly;

impl tonic::codec::Codec for LengthOnly {
    type Encode = v1beta1::Empty;
    type Decode = usize;
    type Encoder = LengthOnly;
    type Decoder = LengthOnly;

    fn encoder(&mut self) -> LengthOnly {
        LengthOnly
    }

    fn decoder(&mut self) -> LengthOnly {
        LengthOnly
    }
}

impl tonic::codec::Encoder for LengthOnly {
    type Item = v1beta1::Empty;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        _: v1beta1::Empty,
        _: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        Ok(())
    }
}

impl tonic::codec::Decoder for LengthOnly {
    type Item = usize;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        buf: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<usize>, tonic::Status> {
        use prost::bytes::Buf as _;
        let len = buf.remaining();
        buf.advance(len);
        Ok(Some(len))
    }
}

/// Opens a ListAndWatch stream of its own on `socket` and reads its first update.
pub fn bare_watch(rt: &tokio::runtime::Runtime, socket: &Path) -> tonic::Streaming<usize> {
    rt.block_on(async {
        let channel = pluglet_uds::connect(socket, TIMEOUT)
            .await
            .expect("dial the peer");
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.expect("peer ready");
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(
            "/v1beta1.DevicePlugin/ListAndWatch",
        );
        let mut stream = grpc
            .server_streaming(tonic::Request::new(v1beta1::Empty {}), path, LengthOnly)
            .await
            .expect("open ListAndWatch")
            .into_inner();
        stream
            .message()
            .await
            .expect("first update")
            .expect("a first update");
        stream
    })
}
