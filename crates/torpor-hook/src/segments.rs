//! The segment table: every segment this process holds, in creation order.
//!
//! A segment is a range of reserved addresses with physical memory mapped over all of it
//! (*mapped*), or with none (*released*: the snapshot step took the memory out and kept the
//! addresses, so memory can be mapped back at the same place after restore). The table also
//! keeps what the restore server needs to fill segments in a useful order: the order they were
//! created in, and the order the function first used them in (set by the harness).

use std::collections::BTreeMap;

use torpor_device::cuda::CudaMemory;
use torpor_device::host::HostMemory;
use torpor_device::PhysicalMemory;

use crate::error::HookError;

/// Where a segment's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// memfd-backed host memory (`torpor.buffer()`, declared data).
    Host,
    /// Device memory of the GPU with this CUDA ordinal (an interposed allocation).
    Cuda { ordinal: i32 },
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Host => "host",
            Backend::Cuda { .. } => "cuda",
        }
    }
}

/// A segment's physical memory.
#[derive(Debug)]
pub enum Memory {
    Host(HostMemory),
    Cuda(CudaMemory),
}

impl Memory {
    pub fn size(&self) -> usize {
        match self {
            Memory::Host(m) => m.size(),
            Memory::Cuda(m) => m.size(),
        }
    }
}

/// What the table says about one segment (a copy, without its memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentInfo {
    pub va: u64,
    /// Bytes, a multiple of the backend's granularity.
    pub size: usize,
    pub backend: Backend,
    /// 0 for the first segment this process created, then 1, 2, …
    pub order: u64,
    /// The place of the segment in first-use order, once the harness has marked it.
    pub first_use: Option<u64>,
    /// Whether it holds memory now.
    pub mapped: bool,
    /// Whether it is mapped read-only (sealed data, or a shared read-only copy).
    pub read_only: bool,
}

#[derive(Debug)]
struct Segment {
    info: SegmentInfo,
    memory: Option<Memory>,
}

/// The segments of this process, by start address.
#[derive(Debug, Default)]
pub struct SegmentTable {
    segments: BTreeMap<u64, Segment>,
    next_order: u64,
    next_first_use: u64,
}

impl SegmentTable {
    /// Records a new mapped segment.
    pub fn insert(&mut self, va: u64, backend: Backend, memory: Memory) -> SegmentInfo {
        let info = SegmentInfo {
            va,
            size: memory.size(),
            backend,
            order: self.next_order,
            first_use: None,
            mapped: true,
            read_only: false,
        };
        self.next_order += 1;
        self.segments.insert(
            va,
            Segment {
                info,
                memory: Some(memory),
            },
        );
        info
    }

    /// Records a new released segment: `size` bytes of addresses at `va`, no memory yet (memory
    /// is mapped there next, as into a segment released for a snapshot).
    pub fn insert_released(&mut self, va: u64, backend: Backend, size: usize) -> SegmentInfo {
        let info = SegmentInfo {
            va,
            size,
            backend,
            order: self.next_order,
            first_use: None,
            mapped: false,
            read_only: false,
        };
        self.next_order += 1;
        self.segments.insert(va, Segment { info, memory: None });
        info
    }

    /// The segment starting at `va`.
    pub fn get(&self, va: u64) -> Result<SegmentInfo, HookError> {
        self.segments
            .get(&va)
            .map(|s| s.info)
            .ok_or(HookError::NotASegment { va })
    }

    /// Whether a segment starts at `va` (the cheap check of every interposed free).
    pub fn contains(&self, va: u64) -> bool {
        self.segments.contains_key(&va)
    }

    /// Forgets the segment starting at `va`, handing back its memory (if mapped).
    pub fn remove(&mut self, va: u64) -> Result<(SegmentInfo, Option<Memory>), HookError> {
        let segment = self
            .segments
            .remove(&va)
            .ok_or(HookError::NotASegment { va })?;
        Ok((segment.info, segment.memory))
    }

    /// Takes the memory out of the segment at `va`, leaving it released.
    pub fn take_memory(&mut self, va: u64) -> Result<Memory, HookError> {
        let segment = self
            .segments
            .get_mut(&va)
            .ok_or(HookError::NotASegment { va })?;
        let memory = segment.memory.take().ok_or(HookError::Released { va })?;
        segment.info.mapped = false;
        segment.info.read_only = false;
        Ok(memory)
    }

    /// Puts memory (mapped by the caller at `va`) into the released segment at `va`.
    pub fn put_memory(
        &mut self,
        va: u64,
        memory: Memory,
        read_only: bool,
    ) -> Result<(), HookError> {
        let segment = self
            .segments
            .get_mut(&va)
            .ok_or(HookError::NotASegment { va })?;
        if segment.memory.is_some() {
            return Err(HookError::NotReleased { va });
        }
        segment.memory = Some(memory);
        segment.info.mapped = true;
        segment.info.read_only = read_only;
        Ok(())
    }

    /// The memory of the mapped segment at `va`.
    pub fn memory(&self, va: u64) -> Result<&Memory, HookError> {
        let segment = self
            .segments
            .get(&va)
            .ok_or(HookError::NotASegment { va })?;
        segment.memory.as_ref().ok_or(HookError::Released { va })
    }

    /// Gives the segment holding address `at` the next place in first-use order, unless it has
    /// one already. Returns the segment as it is now.
    pub fn mark_first_use(&mut self, at: u64) -> Result<SegmentInfo, HookError> {
        let segment = self
            .segments
            .range_mut(..=at)
            .next_back()
            .map(|(_, s)| s)
            .filter(|s| at < s.info.va + s.info.size as u64)
            .ok_or(HookError::NotInASegment { va: at })?;
        if segment.info.first_use.is_none() {
            segment.info.first_use = Some(self.next_first_use);
            self.next_first_use += 1;
        }
        Ok(segment.info)
    }

    /// Every segment, in creation order.
    pub fn list(&self) -> Vec<SegmentInfo> {
        let mut all: Vec<SegmentInfo> = self.segments.values().map(|s| s.info).collect();
        all.sort_by_key(|s| s.order);
        all
    }

    /// The segments that hold memory, in creation order.
    pub fn mapped(&self) -> Vec<SegmentInfo> {
        self.list().into_iter().filter(|s| s.mapped).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_device::host::HostDevice;
    use torpor_device::Device;

    fn memory(device: &HostDevice, pages: usize) -> Memory {
        Memory::Host(device.create(pages * device.granularity()).unwrap())
    }

    #[test]
    fn segments_keep_creation_order_and_first_use_order_is_set_once() {
        let device = HostDevice::new();
        let page = device.granularity() as u64;
        let mut table = SegmentTable::default();
        // Addresses in another order than creation, so the two orders differ.
        table.insert(0x9000_0000, Backend::Host, memory(&device, 2));
        table.insert(
            0x1000_0000,
            Backend::Cuda { ordinal: 0 },
            memory(&device, 1),
        );
        table.insert(0x5000_0000, Backend::Host, memory(&device, 1));
        let list = table.list();
        assert_eq!(
            list.iter().map(|s| (s.va, s.order)).collect::<Vec<_>>(),
            [(0x9000_0000, 0), (0x1000_0000, 1), (0x5000_0000, 2)]
        );
        assert_eq!(list[0].size as u64, 2 * page);
        assert_eq!(list[1].backend.name(), "cuda");

        // Any address inside a segment marks it; a second mark keeps the first place.
        assert_eq!(
            table.mark_first_use(0x5000_0000).unwrap().first_use,
            Some(0)
        );
        assert_eq!(
            table
                .mark_first_use(0x9000_0000 + page + 5)
                .unwrap()
                .first_use,
            Some(1)
        );
        assert_eq!(
            table.mark_first_use(0x5000_0010).unwrap().first_use,
            Some(0)
        );
        assert_eq!(table.get(0x1000_0000).unwrap().first_use, None);
        for outside in [0x9000_0000 + 2 * page, 0x0fff_ffff, 0x1000_0000 + page] {
            assert!(
                matches!(
                    table.mark_first_use(outside),
                    Err(HookError::NotInASegment { .. })
                ),
                "{outside:#x}"
            );
        }
    }

    #[test]
    fn a_segment_made_released_holds_no_memory_until_memory_is_put_there() {
        let device = HostDevice::new();
        let mut table = SegmentTable::default();
        table.insert(0x1000_0000, Backend::Host, memory(&device, 1));
        let page = device.granularity();
        let info = table.insert_released(0x3000_0000, Backend::Cuda { ordinal: 0 }, 2 * page);
        assert_eq!((info.size, info.order, info.mapped), (2 * page, 1, false));
        assert!(matches!(
            table.take_memory(0x3000_0000),
            Err(HookError::Released { .. })
        ));
        assert_eq!(table.mapped().len(), 1);
        table
            .put_memory(0x3000_0000, memory(&device, 2), true)
            .unwrap();
        let info = table.get(0x3000_0000).unwrap();
        assert!(info.mapped && info.read_only);
    }

    #[test]
    fn released_segments_keep_their_place_and_take_memory_back_once() {
        let device = HostDevice::new();
        let mut table = SegmentTable::default();
        table.insert(0x2000_0000, Backend::Host, memory(&device, 1));
        let taken = table.take_memory(0x2000_0000).unwrap();
        assert!(!table.get(0x2000_0000).unwrap().mapped);
        assert!(table.mapped().is_empty());
        assert!(matches!(
            table.take_memory(0x2000_0000),
            Err(HookError::Released { .. })
        ));
        assert!(matches!(
            table.memory(0x2000_0000),
            Err(HookError::Released { .. })
        ));

        table.put_memory(0x2000_0000, taken, true).unwrap();
        let info = table.get(0x2000_0000).unwrap();
        assert!(info.mapped && info.read_only);
        let again = memory(&device, 1);
        let err = table.put_memory(0x2000_0000, again, false).unwrap_err();
        assert!(matches!(err, HookError::NotReleased { .. }), "{err:?}");
        assert!(err
            .to_string()
            .contains("only a released segment can be mapped"));

        assert!(matches!(
            table.get(0x2000_1000),
            Err(HookError::NotASegment { .. })
        ));
        let (info, memory) = table.remove(0x2000_0000).unwrap();
        assert_eq!(info.order, 0);
        assert!(memory.is_some());
        assert!(!table.contains(0x2000_0000));
    }
}
