//! The subset of CRIU's `images/rpc.proto` (proto2) that Torpor speaks, written by hand.
//!
//! Field numbers are CRIU's own and must never change; fields Torpor does not use are left out
//! (prost skips unknown fields when decoding, and CRIU treats absent optional fields as unset).
//! The numbers were taken from rpc.proto as of CRIU 4.1/4.2 (`network_lock` = 64 arrived in 3.x).

/// `criu_req_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum ReqType {
    Empty = 0,
    Dump = 1,
    Restore = 2,
    Check = 3,
    PreDump = 4,
    PageServer = 5,
    Notify = 6,
    CpuinfoDump = 7,
    CpuinfoCheck = 8,
    FeatureCheck = 9,
    Version = 10,
    WaitPid = 11,
    PageServerChld = 12,
    SinglePreDump = 13,
}

/// `criu_network_lock_method`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum NetworkLockMethod {
    Iptables = 1,
    Nftables = 2,
    Skip = 3,
}

/// `criu_opts` (subset).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CriuOpts {
    #[prost(int32, required, tag = "1")]
    pub images_dir_fd: i32,
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
    #[prost(bool, optional, tag = "3")]
    pub leave_running: Option<bool>,
    #[prost(bool, optional, tag = "4")]
    pub ext_unix_sk: Option<bool>,
    #[prost(bool, optional, tag = "5")]
    pub tcp_established: Option<bool>,
    #[prost(bool, optional, tag = "8")]
    pub file_locks: Option<bool>,
    #[prost(int32, optional, tag = "9")]
    pub log_level: Option<i32>,
    #[prost(string, optional, tag = "10")]
    pub log_file: Option<String>,
    #[prost(bool, optional, tag = "12")]
    pub notify_scripts: Option<bool>,
    #[prost(string, optional, tag = "13")]
    pub root: Option<String>,
    /// A previous (pre-)dump's images, relative to `images_dir`: pages unchanged since are
    /// recorded as "in parent" instead of copied (`--prev-images-dir`).
    #[prost(string, optional, tag = "14")]
    pub parent_img: Option<String>,
    /// Track memory changes with the kernel's soft-dirty bits (`--track-mem`).
    #[prost(bool, optional, tag = "15")]
    pub track_mem: Option<bool>,
    #[prost(int32, optional, tag = "17")]
    pub work_dir_fd: Option<i32>,
    #[prost(bool, optional, tag = "18")]
    pub link_remap: Option<bool>,
    #[prost(bool, optional, tag = "24")]
    pub manage_cgroups: Option<bool>,
    #[prost(bool, optional, tag = "26")]
    pub rst_sibling: Option<bool>,
    #[prost(message, repeated, tag = "27")]
    pub inherit_fd: Vec<InheritFd>,
    #[prost(string, repeated, tag = "37")]
    pub external: Vec<String>,
    #[prost(uint32, optional, tag = "38")]
    pub empty_ns: Option<u32>,
    #[prost(bool, optional, tag = "48")]
    pub lazy_pages: Option<bool>,
    #[prost(bool, optional, tag = "50")]
    pub orphan_pts_master: Option<bool>,
    #[prost(enumeration = "NetworkLockMethod", optional, tag = "64")]
    pub network_lock: Option<i32>,
}

/// `inherit_fd`: restore the file the image knows as `key` from descriptor `fd` of the `criu
/// swrk` process instead of reopening it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InheritFd {
    #[prost(string, required, tag = "1")]
    pub key: String,
    #[prost(int32, required, tag = "2")]
    pub fd: i32,
}

/// `criu_req`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CriuReq {
    #[prost(enumeration = "ReqType", required, tag = "1")]
    pub r#type: i32,
    #[prost(message, optional, tag = "2")]
    pub opts: Option<CriuOpts>,
    #[prost(bool, optional, tag = "3")]
    pub notify_success: Option<bool>,
}

/// `criu_restore_resp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CriuRestoreResp {
    #[prost(int32, required, tag = "1")]
    pub pid: i32,
}

/// `criu_notify`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CriuNotify {
    #[prost(string, optional, tag = "1")]
    pub script: Option<String>,
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
}

/// `criu_version`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CriuVersion {
    #[prost(int32, required, tag = "1")]
    pub major_number: i32,
    #[prost(int32, required, tag = "2")]
    pub minor_number: i32,
    #[prost(string, optional, tag = "3")]
    pub gitid: Option<String>,
    #[prost(int32, optional, tag = "4")]
    pub sublevel: Option<i32>,
}

/// `criu_resp` (subset).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CriuResp {
    #[prost(enumeration = "ReqType", required, tag = "1")]
    pub r#type: i32,
    #[prost(bool, required, tag = "2")]
    pub success: bool,
    #[prost(message, optional, tag = "4")]
    pub restore: Option<CriuRestoreResp>,
    #[prost(message, optional, tag = "5")]
    pub notify: Option<CriuNotify>,
    #[prost(int32, optional, tag = "7")]
    pub cr_errno: Option<i32>,
    #[prost(string, optional, tag = "9")]
    pub cr_errmsg: Option<String>,
    #[prost(message, optional, tag = "10")]
    pub version: Option<CriuVersion>,
}

/// `CLONE_NEWNET` as CRIU's `empty_ns` mask wants it.
pub const EMPTY_NS_NET: u32 = libc::CLONE_NEWNET as u32;

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// The wire bytes pin the field numbers: a wrong tag here would silently set another option.
    #[test]
    fn request_fields_have_criu_tags() {
        let req = CriuReq {
            r#type: ReqType::Restore as i32,
            opts: Some(CriuOpts {
                images_dir_fd: 5,
                rst_sibling: Some(true),
                inherit_fd: vec![InheritFd {
                    key: "a".into(),
                    fd: 7,
                }],
                empty_ns: Some(EMPTY_NS_NET),
                network_lock: Some(NetworkLockMethod::Skip as i32),
                lazy_pages: Some(true),
                ..Default::default()
            }),
            notify_success: None,
        };
        let opts = [
            0x08, 5, // 1: images_dir_fd
            0xd0, 0x01, 1, // 26: rst_sibling
            0xda, 0x01, 5, 0x0a, 1, b'a', 0x10, 7, // 27: inherit_fd {key: "a", fd: 7}
            0xb0, 0x02, 0x80, 0x80, 0x80, 0x80, 0x04, // 38: empty_ns = 0x40000000
            0x80, 0x03, 1, // 48: lazy_pages
            0x80, 0x04, 3, // 64: network_lock = SKIP
        ];
        let mut want = vec![0x08, 2, 0x12, opts.len() as u8];
        want.extend_from_slice(&opts);
        assert_eq!(req.encode_to_vec(), want);
    }

    /// A pre-dump's chain: `parent_img` is CRIU's 14, `track_mem` its 15.
    #[test]
    fn pre_dump_fields_have_criu_tags() {
        let opts = CriuOpts {
            images_dir_fd: 5,
            parent_img: Some("../1".into()),
            track_mem: Some(true),
            ..Default::default()
        };
        assert_eq!(
            opts.encode_to_vec(),
            [0x08, 5, 0x72, 4, b'.', b'.', b'/', b'1', 0x78, 1]
        );
    }

    #[test]
    fn response_decodes_errno_and_message() {
        let resp = CriuResp {
            r#type: ReqType::Dump as i32,
            success: false,
            cr_errno: Some(libc::ESRCH),
            cr_errmsg: Some("no such task".into()),
            ..Default::default()
        };
        let back = CriuResp::decode(resp.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!(back, resp);
        // An unknown field (11: status) is skipped, not an error.
        let mut bytes = resp.encode_to_vec();
        bytes.extend_from_slice(&[0x58, 7]);
        assert_eq!(CriuResp::decode(bytes.as_slice()).expect("decodes"), resp);
    }
}
