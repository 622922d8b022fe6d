//! The communication store's GPU values (issue 11 item 4; docs/sandboxes.md, "The
//! communication store"): `torpor.put(key, cuda_tensor, shared=True)` in a sandbox and
//! `torpor.get(key)` in another sandbox of the tenant on the node.
//!
//! **Put.** The worker sends `store_put` with `gpu` {bytes, ordinal}. The daemon allocates that
//! many bytes (padded to the granularity) of exportable memory on the tensor's GPU with its own
//! device layer (`torpor-device`, as the restore server makes segments), and answers
//! `store_memory` with an fd of it. The worker maps it writable, copies the tensor in (one
//! device-to-device copy, after synchronising the context so the tensor's producers are done),
//! synchronises, unmaps it and sends `store_written`; the daemon seals the memory read-only and
//! only then stores it under the key (replacing what the key held), answering `store_stored`.
//! A put that fails anywhere leaves the key as it was; the daemon takes back memory a worker
//! never finished within [`super::store::GPU_PUT_TIMEOUT`].
//!
//! Why the daemon owns the memory rather than the putter exporting its own: a value must outlive
//! the sandbox that put it (consumed by another, the putter hibernated or gone), be moved to host
//! memory when the GPU is short without asking the putter, and be freed when consumed or expired;
//! memory the putter's allocator owns can do none of that, and the hook's segments are the
//! putter's snapshot state. One device copy at the put is the price.
//!
//! **Get.** A get in a worker whose GPU holds the value is answered with an fd of the very
//! memory (`source` "stored"): the worker maps it read-only and wraps a tensor around it, no
//! copy. On another GPU the daemon first copies it GPU to GPU into memory on the getter's GPU
//! (`Device::copy_from_peer`, where `cuDeviceCanAccessPeer`; "peer"), else through host memory
//! (device to the getter GPU's pinned staging, then up through that GPU's fair PCIe scheduler;
//! "host"), and hands that copy over; it is the getter's, freed when its mapping goes.
//!
//! **Pressure.** The store's GPU values take at most `[store] gpu_bytes` of each GPU (all
//! tenants together; puts in progress count). A put that would pass it first moves the oldest
//! values on that GPU to sealed memfds in host memory; an allocation the driver refuses for lack
//! of memory does the same, one value at a time, and is tried again. A get of a spilled value
//! copies it up into memory on the getter's GPU through that GPU's PCIe scheduler (so it takes
//! fair turns with restores and GPU data fills: docs/sandboxes.md, "Fair PCIe"), "spilled". The
//! value stays in host memory for later gets.
//!
//! A value's GPU memory is the daemon's handle plus every worker mapping of it: consumed or
//! expired, the daemon drops its handle, and the memory goes back once no worker maps it (an
//! exported fd, like a mapping, keeps the physical memory: `torpor-device`'s contract).

use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::store::{
    reply_stored, reply_stored_leasing, reply_to, Delivered, SealedPut, SpareFor, StoreError,
    Taken, TakenHeld,
};
use super::Instance;
use crate::protocol::{StoreMemory, StorePut, StoreValueGpu, StoreWritten, ToWorker};
use crate::split::device::SegmentDevice;
use crate::sync::lock;

/// The ticket of put `id` of `inst`'s worker.
fn ticket(inst: &Instance, id: u64) -> String {
    format!("{}/{id}", inst.id)
}

/// The node's GPU `ordinal`, opened; the error names the worker's ordinal too.
fn gpu(
    rt: &super::Runtime,
    worker: i32,
    ordinal: i32,
) -> Result<Arc<dyn SegmentDevice>, StoreError> {
    rt.split
        .device("cuda", ordinal)
        .map_err(|e| StoreError::NoGpu {
            worker,
            ordinal,
            reason: e.to_string(),
        })
}

impl super::Runtime {
    /// A worker's `store_put` with `gpu`: memory allocated and sent (`store_memory`), on the
    /// blocking pool (it may move values to host memory first).
    pub(crate) fn store_put_gpu(self: &Arc<Self>, inst: &Arc<Instance>, put: StorePut) {
        if let Some(block) = put.gpu.as_ref().and_then(|g| g.lease) {
            if put.nodes.is_none() {
                self.store_put_leased(inst, put, block);
                return;
            }
        }

        if put.nodes.is_some() && self.objstore.is_none() {
            // For every node it goes through the bucket (crate::runtime::store_nodes).
            let frame = StoreMemory {
                id: put.id,
                ok: false,
                padded: None,
                ordinal: None,
                fd: None,
                block: None,
                error: Some(StoreError::NoObjstore.to_string()),
            };
            reply_to(inst, ToWorker::StoreMemory(frame), None);
            return;
        }
        // With a spare of its size and nothing to move, from here: no driver call.
        match self.store_reserve(inst, put.clone(), true) {
            Ok(None) => {}
            done => {
                let reserved = done.map(|r| r.expect("Some: matched None above"));
                self.store_answer_put(inst, &put, reserved);
                return;
            }
        }
        let rt = Arc::clone(self);
        let inst = Arc::clone(inst);
        tokio::spawn(async move {
            let (rt2, inst2, put2) = (Arc::clone(&rt), Arc::clone(&inst), put.clone());
            let reserved = tokio::task::spawn_blocking(move || {
                rt2.store_reserve(&inst2, put2, false)
                    .map(|r| r.expect("a reservation that may block always ends"))
            })
            .await
            .unwrap_or_else(|e| Err(StoreError::Task(e.to_string())));
            rt.store_answer_put(&inst, &put, reserved);
        });
    }

    /// A leased put (protocol 4): the worker filled its lease already, so it is sealed and
    /// stored from here (no driver call on cuda: the seal is the daemon's own mark) and answered
    /// `store_stored`, with the next lease.
    fn store_put_leased(self: &Arc<Self>, inst: &Arc<Instance>, put: StorePut, block: u64) {
        let (bytes, ordinal) = put
            .gpu
            .as_ref()
            .map_or((0, 0), |g| (g.bytes, inst.daemon_ordinal(g.ordinal)));
        let stored = match self.store_tenant(inst) {
            Some(tenant) => self.store.put_leased(
                inst.store_holder,
                &tenant,
                &put.key,
                put.meta,
                put.ttl_s,
                bytes,
                block,
                ordinal,
            ),
            None => Err(StoreError::Fd(std::io::Error::other(
                "the instance has no pool any more",
            ))),
        };
        match stored {
            Ok(spare) => {
                let lease = self.store_lease(inst, &spare);
                self.store_metrics();
                reply_stored_leasing(inst, put.id, &put.key, Ok(()), lease);
                self.store_make_spare(spare);
            }
            Err(e) => {
                self.store_metrics();
                reply_stored(inst, put.id, &put.key, Err(e));
            }
        }
    }

    /// Memory set aside for `inst`'s next put like the one just stored (`spare` says its size
    /// and GPU), for a protocol-4 worker: the frame's part and the fd.
    fn store_lease(
        &self,
        inst: &Arc<Instance>,
        spare: &SpareFor,
    ) -> Option<(crate::protocol::StoreLease, OwnedFd)> {
        if !inst.keeps_store_mappings {
            return None;
        }
        let (block, fd) = self.store.lease(
            inst.store_holder,
            &spare.tenant,
            spare.ordinal,
            spare.padded,
        )?;
        // The worker maps it to fill it and keeps that mapping: told when the block goes.
        self.store_mapped_by(inst, block, true);
        let granule = spare.device.granularity().max(1) as u64;
        let lease = crate::protocol::StoreLease {
            block,
            padded: spare.padded,
            min_bytes: spare.padded.saturating_sub(granule) + 1,
            ordinal: inst.worker_ordinal(spare.ordinal),
        };
        Some((lease, fd))
    }

    /// Answers a GPU put's `store_memory`.
    fn store_answer_put(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
        put: &StorePut,
        reserved: Result<(super::store::Reserved, i32), StoreError>,
    ) {
        self.store_metrics();
        let (frame, fd) = match reserved {
            Ok((r, ordinal)) => (
                StoreMemory {
                    id: put.id,
                    ok: true,
                    padded: Some(r.padded),
                    ordinal: Some(ordinal),
                    fd: Some(true),
                    block: self.store_mapped_by(inst, r.block, r.recycled),
                    error: None,
                },
                Some(r.fd),
            ),
            Err(e) => {
                tracing::info!(instance = %inst.id, key = %put.key, error = %e, "store: GPU value refused");
                (
                    StoreMemory {
                        id: put.id,
                        ok: false,
                        padded: None,
                        ordinal: None,
                        fd: None,
                        block: None,
                        error: Some(e.to_string()),
                    },
                    None,
                )
            }
        };
        reply_to(inst, ToWorker::StoreMemory(frame), fd);
    }

    /// Makes the spare for the next put like one just stored (on the blocking pool). Only once
    /// the put is written: the putter's import, mapping and copy are done by then, and the
    /// export (0.7 ms at 100 MiB) does not run beside them in the driver.
    fn store_make_spare(self: &Arc<Self>, spare: SpareFor) {
        let rt = Arc::clone(self);
        tokio::spawn(async move {
            let rt2 = Arc::clone(&rt);
            let _ = tokio::task::spawn_blocking(move || {
                rt2.store.make_spare(spare);
            })
            .await;
            rt.store_metrics();
        });
    }

    /// The put's memory: with `spare_only`, only where that takes no driver call (a spare of
    /// its size, nothing to move; `Ok(None)` otherwise, nothing changed: the GPU is not even
    /// opened), else whatever it takes.
    fn store_reserve(
        &self,
        inst: &Instance,
        put: StorePut,
        spare_only: bool,
    ) -> Result<Option<(super::store::Reserved, i32)>, StoreError> {
        let Some(g) = put.gpu else {
            return Err(StoreError::EmptyGpu);
        };
        let ordinal = inst.daemon_ordinal(g.ordinal);
        if spare_only && !self.store.has_spare(ordinal) {
            return Ok(None);
        }
        let tenant = self.store_tenant(inst).ok_or_else(|| {
            StoreError::Fd(std::io::Error::other("the instance has no pool any more"))
        })?;
        let device = gpu(self, g.ordinal, ordinal)?;
        let Some(r) = self.store.reserve_gpu_with(
            &ticket(inst, put.id),
            &tenant,
            &put.key,
            put.meta,
            put.ttl_s,
            g.bytes,
            ordinal,
            device,
            put.nodes.is_some(),
            spare_only,
        )?
        else {
            return Ok(None);
        };
        if r.spilled > 0 {
            self.metrics.store_spills.inc_by(r.spilled as u64);
        }
        Ok(Some((r, ordinal)))
    }

    /// A worker's `store_written`: the value sealed and stored (or dropped), `store_stored`. A
    /// put for every node is uploaded first (crate::runtime::store_nodes), on the blocking pool.
    pub(crate) fn store_written(self: &Arc<Self>, inst: &Arc<Instance>, w: StoreWritten) {
        let stored = match self.store.seal_gpu(&ticket(inst, w.id), w.ok) {
            Err(e) => Err(e),
            Ok(SealedPut::Stored(spare)) => {
                let lease = self.store_lease(inst, &spare);
                self.store_metrics();
                reply_stored_leasing(inst, w.id, "(GPU put)", Ok(()), lease);
                self.store_make_spare(spare);
                return;
            }
            Ok(SealedPut::Dropped) => Err(StoreError::Worker(
                w.error.unwrap_or_else(|| "no reason given".into()),
            )),
            Ok(SealedPut::ForNodes(sealed)) => {
                let spare = sealed.gpu.spare_for(&sealed.tenant);
                self.store_publish_gpu(inst, w.id, sealed);
                self.store_make_spare(spare);
                return;
            }
        };
        self.store_metrics();
        reply_stored(inst, w.id, "(GPU put)", stored);
    }

    /// A GPU value already on the GPU of `inst`'s worker: a `dup` of its memory's export, no
    /// driver call (so the caller need not leave the runtime's thread for it). None for a value
    /// elsewhere, which needs a copy ([`Self::store_deliver`]).
    pub(crate) fn store_deliver_in_place(
        inst: &Instance,
        t: &Taken,
    ) -> Option<Result<Delivered, StoreError>> {
        let target = inst.daemon_ordinal(0);
        match &t.held {
            TakenHeld::Gpu(g) if g.ordinal == target => Some(
                g.fd()
                    .map(|fd| delivered(t.meta.clone(), t.bytes, fd, g.padded, target, "stored")),
            ),
            _ => None,
        }
    }

    /// A GPU value on the GPU of `inst`'s worker (its GPU 0): an fd of the value's own memory,
    /// or of a copy made there.
    pub(crate) fn store_deliver(
        &self,
        inst: &Instance,
        t: &Taken,
    ) -> Result<Delivered, StoreError> {
        if let Some(d) = Self::store_deliver_in_place(inst, t) {
            return d;
        }
        let target = inst.daemon_ordinal(0);
        let dev = gpu(self, 0, target)?;
        let dev_err = |what| move |source| StoreError::Device { what, source };
        let (memory, padded, source) = match &t.held {
            // On another GPU (on the getter's, it was delivered in place above).
            TakenHeld::Gpu(g) => {
                let len = usize::try_from(g.padded).unwrap_or(usize::MAX);
                let peer = dev
                    .fill_from_peer(&*g.device, &g.memory, len, true)
                    .map_err(dev_err("copying the value GPU to GPU"))?;
                match peer {
                    Some(m) => (m, g.padded, "peer"),
                    None => {
                        let mut buf = dev.host_buffer(len).map_err(dev_err("staging"))?;
                        g.device
                            .read_memory(&g.memory, &mut buf)
                            .map_err(dev_err("copying the value to host memory"))?;
                        let m = dev
                            .fill_from_bytes(&buf, true)
                            .map_err(dev_err("copying the value up to the worker's GPU"))?;
                        (m, g.padded, "host")
                    }
                }
            }
            TakenHeld::Host(fd) => {
                // A spill holds whole granules; a value from the bucket holds its bytes only,
                // and the memory made for it is rounded up (the tail zeroed).
                let held = usize::try_from(t.held_bytes).unwrap_or(usize::MAX);
                let granule = dev.granularity().max(1);
                let len = held.div_ceil(granule).saturating_mul(granule);
                let mut buf = dev.host_buffer(len).map_err(dev_err("staging"))?;
                std::fs::File::from(fd.try_clone().map_err(StoreError::Fd)?)
                    .read_exact_at(&mut buf[..held], 0)
                    .map_err(StoreError::Spill)?;
                buf[held..].fill(0);
                let m = dev
                    .fill_from_bytes(&buf, true)
                    .map_err(dev_err("copying the spilled value up to the worker's GPU"))?;
                (m, len as u64, "spilled")
            }
        };
        let fd = dev
            .export(&memory)
            .map_err(dev_err("exporting the copy's GPU memory"))?;
        Ok(delivered(
            t.meta.clone(),
            t.bytes,
            fd,
            padded,
            target,
            source,
        ))
    }

    /// `block`, sent to `inst`'s worker: the block to name in the frame when the worker may
    /// keep its mapping (protocol 4, and memory that comes back to the tenant: `recycled`),
    /// with the worker recorded as one to tell when the store lets go of it.
    pub(crate) fn store_mapped_by(
        &self,
        inst: &Arc<Instance>,
        block: u64,
        recycled: bool,
    ) -> Option<u64> {
        if !(recycled && inst.keeps_store_mappings) {
            return None;
        }
        let mut mappers = lock(&self.store_mappers);
        let list = mappers.entry(block).or_default();
        list.retain(|w| w.strong_count() > 0);
        if !list
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(inst)))
        {
            list.push(Arc::downgrade(inst));
        }
        Some(block)
    }

    /// A GPU value delivered in place to `inst`'s worker (the very memory): its block named
    /// and held for the worker where it keeps mappings, else held for good (a worker of an
    /// older protocol never releases: that block never comes back).
    pub(crate) fn store_lend(&self, inst: &Arc<Instance>, t: &Taken, d: &mut Delivered) {
        let TakenHeld::Gpu(g) = &t.held else {
            return;
        };
        let block = self.store_mapped_by(inst, g.block.id, self.store.recycles(g));
        let holder = match block {
            Some(_) => inst.store_holder,
            None => super::store::NO_RELEASE,
        };
        self.store.hold(g.block.id, holder);
        if let Some(gpu) = d.gpu.as_mut() {
            gpu.block = block;
        }
    }

    /// Tells the workers that kept mappings of the blocks the store let go of to unmap them
    /// (`store_unmap`), so that their memory goes back to the GPU.
    pub(crate) fn store_unmap_gone(&self) {
        let gone = self.store.take_gone();
        if gone.is_empty() {
            return;
        }
        let mut by_worker: Vec<(Arc<Instance>, Vec<u64>)> = Vec::new();
        {
            let mut mappers = lock(&self.store_mappers);
            for block in gone {
                for inst in mappers.remove(&block).into_iter().flatten() {
                    let Some(inst) = inst.upgrade() else {
                        continue;
                    };
                    match by_worker.iter_mut().find(|(i, _)| Arc::ptr_eq(i, &inst)) {
                        Some((_, blocks)) => blocks.push(block),
                        None => by_worker.push((inst, vec![block])),
                    }
                }
            }
        }
        for (inst, blocks) in by_worker {
            let frame = ToWorker::StoreUnmap(crate::protocol::StoreUnmap { blocks });
            reply_to(&inst, frame, None);
        }
    }

    /// A worker's `store_release`: its gets of those blocks are done, and those leases unused.
    pub(crate) fn store_release(&self, inst: &Instance, blocks: &[u64], leases: &[u64]) {
        self.store.release(inst.store_holder, blocks);
        for &block in leases {
            self.store.return_lease(inst.store_holder, block);
        }
        self.store_metrics();
    }

    /// The store's gauges, from what it holds now.
    pub(crate) fn store_metrics(&self) {
        self.store_unmap_gone();
        let (per_gpu, spilled) = self.store.gpu_usage();
        for u in per_gpu {
            let device = format!("cuda{}", u.ordinal);
            self.metrics
                .store_gpu_bytes
                .with_label_values(&[&device])
                .set(i64::try_from(u.held).unwrap_or(i64::MAX));
            self.metrics
                .store_gpu_spare_bytes
                .with_label_values(&[&device])
                .set(i64::try_from(u.spare).unwrap_or(i64::MAX));
        }
        self.metrics
            .store_spilled_bytes
            .set(i64::try_from(spilled).unwrap_or(i64::MAX));
    }

    /// The keep-alive tick's part: expired values and abandoned puts dropped, gauges updated.
    pub(crate) fn store_tick(&self) {
        self.store.sweep();
        self.store_metrics();
    }
}

fn delivered(
    meta: serde_json::Value,
    bytes: u64,
    fd: OwnedFd,
    padded: u64,
    ordinal: i32,
    source: &str,
) -> Delivered {
    Delivered {
        meta,
        bytes,
        fd,
        gpu: Some(StoreValueGpu {
            padded,
            ordinal,
            source: source.to_string(),
            block: None,
        }),
    }
}
