//! Which of the node's devices a cold start lands on (`restore_server.placement`).
//!
//! A function snapshot records the GPU of its deploy: the daemon's GPU 0, since workers see
//! every GPU of the node and load on their ordinal 0. Until this module every cold start
//! restored there, so a node of eight GPUs ran every instance on one of them and let seven
//! idle. With `placement = "spread"` (the default) a cold start restores onto the device of
//! the deploy's model that has the fewest instances and starts in flight, the lowest ordinal
//! among equals (the deploy's GPU, whose GPU cache is warm, first):
//!
//! - the driver's restore moves the process's CUDA state onto it (`cuCheckpointProcessRestore`
//!   with GPU pairs, as `torpor restore --gpu 0=N` and a live migration do: the two GPUs'
//!   UUIDs swap under the process, so its ordinal 0 is then that GPU);
//! - the restore server fills its segments there (its GPU cache holds a copy per GPU);
//! - the worker maps them with its own ordinal 0 (`Instance::gpu_map` records the swap).
//!
//! A device whose restore found too little free memory is passed over for
//! [`SHORT_MEMORY_PAUSE`], so a GPU that other processes fill does not take every start.
//! Standbys are placed the same way (their driver restore passes the pairs: a live one's when
//! it is made, a released one's at its first request). Wakes restore where their hibernation was
//! taken (its instance's placement file), and one that finds that GPU full has it passed over
//! by the cold start that replaces it; the deploy's own restores stay where their snapshot
//! was taken. `placement = "first"` keeps every cold start on the
//! deploy's device, as before.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::Placement;
use crate::runtime::pool::FnInfo;
use crate::runtime::Runtime;
use crate::sync::lock;

/// How long a device whose restore found too little free GPU memory is passed over.
pub const SHORT_MEMORY_PAUSE: Duration = Duration::from_secs(2);

/// The driver's GPU map of a start placed on GPU `d`: the deploy's GPU 0 onto `d` (the pairs
/// then swap the two under the process).
pub fn from_deploy_gpu_onto(d: u32) -> Vec<torpor_snapshot::gpu_map::GpuMapping> {
    use torpor_snapshot::gpu_map::{GpuMapping, GpuRef};
    vec![GpuMapping {
        old: GpuRef::Ordinal(0),
        new: GpuRef::Ordinal(d),
    }]
}

/// One device a cold start may land on, as [`choose`] weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub ordinal: u32,
    /// Its live instances and the starts in flight onto it.
    pub load: usize,
    /// A restore onto it found too little free memory within [`SHORT_MEMORY_PAUSE`].
    pub short: bool,
}

/// The device to restore onto: the least loaded of those not short of memory, else of all;
/// the lowest ordinal among equals. `None` for no candidates.
pub fn choose(candidates: &[Candidate]) -> Option<u32> {
    candidates
        .iter()
        .min_by_key(|c| (c.short, c.load, c.ordinal))
        .map(|c| c.ordinal)
}

/// The starts in flight per device, and the devices found short of memory lately.
#[derive(Debug, Default)]
pub struct Placing {
    state: Mutex<PlacingState>,
}

#[derive(Debug, Default)]
struct PlacingState {
    starting: HashMap<u32, usize>,
    /// Per function, its starts in flight.
    starting_of: HashMap<String, usize>,
    /// The device of each instance in flight, by id: from its adoption (when the API lists
    /// it) until its start ends it is in no pool yet, and its placement file may not be
    /// written.
    device_of: HashMap<String, u32>,
    short_until: HashMap<u32, Instant>,
}

/// A cold start's device, counted as a start in flight onto it until dropped.
#[derive(Debug)]
pub struct Placed<'a> {
    placing: &'a Placing,
    /// The function whose starts in flight it counts in (`None`: a standby, which never leads
    /// and keeps no cold start from leading).
    function: Option<String>,
    /// The instance it starts.
    instance: String,
    pub ordinal: u32,
    /// The first start of its function with nothing live: the instance that will serve the
    /// burst (late binding), whose driver restore goes alone on the node
    /// (torpor_snapshot::gpu_restore_slots).
    pub leads: bool,
}

impl Placed<'_> {
    /// Its restore found too little free memory there: pass the device over for a while.
    pub fn short_of_memory(&self) {
        self.placing.short_of_memory_on(self.ordinal);
    }
}

impl Drop for Placed<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.placing.state);
        if let Some(n) = st.starting.get_mut(&self.ordinal) {
            *n = n.saturating_sub(1);
        }
        st.device_of.remove(&self.instance);
        let Some(function) = &self.function else {
            return;
        };
        if let Some(n) = st.starting_of.get_mut(function) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                st.starting_of.remove(function);
            }
        }
    }
}

impl Placing {
    /// Chooses among `devices` (ordinals) given their live instances (`live`), and counts the
    /// start of `instance` of `function` (with `function_live` live instances) onto the one
    /// chosen, in one step: starts of a burst placed at once see each other.
    pub fn place(
        &self,
        function: &str,
        instance: &str,
        function_live: usize,
        devices: &[u32],
        live: &HashMap<u32, usize>,
    ) -> Option<Placed<'_>> {
        self.place_counted(Some(function), instance, function_live, devices, live)
    }

    /// A restore onto device `ordinal` found too little free memory there (a placed start's,
    /// or a wake's, which goes where its hibernation was taken): pass it over for a while.
    pub fn short_of_memory_on(&self, ordinal: u32) {
        lock(&self.state)
            .short_until
            .insert(ordinal, Instant::now() + SHORT_MEMORY_PAUSE);
    }

    /// Whether one of `devices` was not found short of memory lately: a start placed now goes
    /// there (short devices are passed over while another is not).
    pub fn any_not_short(&self, devices: &[u32]) -> bool {
        let mut st = lock(&self.state);
        let now = Instant::now();
        st.short_until.retain(|_, until| *until > now);
        devices.iter().any(|d| !st.short_until.contains_key(d))
    }

    /// The device of `instance` while its placed start is in flight.
    pub fn device_of(&self, instance: &str) -> Option<u32> {
        lock(&self.state).device_of.get(instance).copied()
    }

    /// As [`Placing::place`]; `function` `None` counts the start on its device only.
    fn place_counted(
        &self,
        function: Option<&str>,
        instance: &str,
        function_live: usize,
        devices: &[u32],
        live: &HashMap<u32, usize>,
    ) -> Option<Placed<'_>> {
        let mut st = lock(&self.state);
        let now = Instant::now();
        st.short_until.retain(|_, until| *until > now);
        let candidates: Vec<Candidate> = devices
            .iter()
            .map(|&ordinal| Candidate {
                ordinal,
                load: live.get(&ordinal).copied().unwrap_or(0)
                    + st.starting.get(&ordinal).copied().unwrap_or(0),
                short: st.short_until.contains_key(&ordinal),
            })
            .collect();
        let ordinal = choose(&candidates)?;
        *st.starting.entry(ordinal).or_default() += 1;
        st.device_of.insert(instance.to_string(), ordinal);
        let leads = match function {
            Some(f) => {
                let of = st.starting_of.entry(f.to_string()).or_default();
                let leads = function_live == 0 && *of == 0;
                *of += 1;
                leads
            }
            None => false,
        };
        Some(Placed {
            placing: self,
            function: function.map(str::to_string),
            instance: instance.to_string(),
            ordinal,
            leads,
        })
    }
}

impl Runtime {
    /// The device a cold start (instance `id`) of `info` restores onto, counted as starting
    /// there until the guard is dropped; `None` where placement does not apply
    /// (`placement = "first"`, a node of one device, a CPU function without the host backend's
    /// devices).
    pub(crate) fn place_cold_start(
        &self,
        name: &str,
        id: &str,
        info: &FnInfo,
    ) -> Option<Placed<'_>> {
        self.place_start(name, id, info, true)
    }

    /// A standby's device, as a cold start's: it serves there once a request takes it.
    /// It never leads (nothing waits for it).
    pub(crate) fn place_standby(&self, name: &str, id: &str, info: &FnInfo) -> Option<Placed<'_>> {
        self.place_start(name, id, info, false)
    }

    fn place_start(
        &self,
        name: &str,
        id: &str,
        info: &FnInfo,
        may_lead: bool,
    ) -> Option<Placed<'_>> {
        if self.config.restore_server.placement == Placement::First {
            return None;
        }
        let devices = if info.gpu {
            self.gpus_like_the_first().to_vec()
        } else if self.config.split
            && self.config.restore_server.host_devices > 1
            && self.has_segments(info)
        {
            // A CPU instance is on a host device only through its segments.
            (0..self.config.restore_server.host_devices).collect()
        } else {
            return None;
        };
        if devices.len() < 2 {
            return None;
        }
        let function_live = lock(&self.pools).get(name).map_or(0, |p| {
            lock(&p.state)
                .instances
                .iter()
                .filter(|(i, _)| !i.is_dead())
                .count()
        });
        self.placing.place_counted(
            may_lead.then_some(name),
            id,
            function_live,
            &devices,
            &self.live_instances_per_device(),
        )
    }

    /// Whether a GPU cold start that found too little free memory may be tried again at once:
    /// placement spreads and another GPU of the deploy's model was not found short lately, so
    /// the next start goes there (a request would otherwise wait [`super::pool::GPU_RETRY`]
    /// for a GPU it never tried). Each try marks its GPU short: at most one try per GPU.
    pub(crate) fn another_gpu_to_try(&self) -> bool {
        if self.config.restore_server.placement == Placement::First {
            return false;
        }
        let devices = self.gpus_like_the_first();
        devices.len() >= 2 && self.placing.any_not_short(devices)
    }

    /// The ordinals of the node's GPUs of the model of GPU 0 (the deploy's GPU: the driver
    /// restores a process only onto a GPU of its model), read from the driver once.
    fn gpus_like_the_first(&self) -> &[u32] {
        self.gpus_of_first_model.get_or_init(|| {
            let Ok(Ok(devices)) = self.cuda().map(|d| d.devices()) else {
                return Vec::new();
            };
            let Some(first) = devices.iter().find(|d| d.ordinal == 0) else {
                return Vec::new();
            };
            devices
                .iter()
                .filter(|d| d.name == first.name)
                .filter_map(|d| u32::try_from(d.ordinal).ok())
                .collect()
        })
    }

    /// Whether `info`'s function snapshot has segments (its plan, read once and kept).
    fn has_segments(&self, info: &FnInfo) -> bool {
        let tenant = crate::tenant::of_spec(&info.spec);
        matches!(self.split.plan(&info.snapshot_id, tenant), Ok(Some(p)) if !p.is_empty())
    }

    /// The live instances on each device.
    fn live_instances_per_device(&self) -> HashMap<u32, usize> {
        let pools: Vec<_> = lock(&self.pools).values().cloned().collect();
        let mut per = HashMap::new();
        for p in &pools {
            for (i, _) in lock(&p.state)
                .instances
                .iter()
                .filter(|(i, _)| !i.is_dead())
            {
                *per.entry(i.gpu.load(Ordering::SeqCst)).or_default() += 1;
            }
        }
        per
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DriverLanes;

    fn c(ordinal: u32, load: usize, short: bool) -> Candidate {
        Candidate {
            ordinal,
            load,
            short,
        }
    }

    #[test]
    fn the_least_loaded_device_is_chosen_and_the_lowest_ordinal_among_equals() {
        assert_eq!(
            choose(&[c(0, 2, false), c(1, 1, false), c(2, 1, false)]),
            Some(1)
        );
        assert_eq!(choose(&[c(0, 0, false), c(1, 0, false)]), Some(0));
        assert_eq!(choose(&[]), None);
    }

    #[test]
    fn a_device_short_of_memory_is_passed_over_unless_all_are() {
        assert_eq!(choose(&[c(0, 0, true), c(1, 5, false)]), Some(1));
        assert_eq!(choose(&[c(0, 3, true), c(1, 1, true)]), Some(1));
    }

    #[test]
    fn a_burst_placed_at_once_spreads_and_gives_its_counts_back() {
        let placing = Placing::default();
        let live = HashMap::from([(0, 1)]);
        let held: Vec<Placed<'_>> = (0..7)
            .map(|i| {
                placing
                    .place("f", &format!("b{i}"), 0, &[0, 1], &live)
                    .expect("a device")
            })
            .collect();
        let on = |d| held.iter().filter(|p| p.ordinal == d).count();
        // The burst's first start leads (its function has nothing live), no other.
        assert_eq!(held.iter().filter(|p| p.leads).count(), 1);
        assert!(held[0].leads);
        // With the one live instance on device 0: four starts each, loads equal at the end.
        assert_eq!((on(0), on(1)), (3, 4));
        drop(held);
        let next = placing
            .place("f", "i2", 0, &[0, 1], &HashMap::new())
            .expect("a device");
        assert_eq!(next.ordinal, 0, "the starts' counts were not given back");
    }

    #[test]
    fn a_start_may_try_again_at_once_while_a_device_is_not_short() {
        let placing = Placing::default();
        assert!(placing.any_not_short(&[0, 1]));
        for ordinal in [0, 1] {
            let p = placing
                .place("f", &format!("s{ordinal}"), 0, &[0, 1], &HashMap::new())
                .expect("a device");
            assert_eq!(p.ordinal, ordinal, "the short one is passed over");
            p.short_of_memory();
        }
        // Both tried: a request waits now, and is not placed in a loop.
        assert!(!placing.any_not_short(&[0, 1]));
        assert!(placing.any_not_short(&[0, 1, 2]));
    }

    #[test]
    fn a_device_found_short_is_passed_over_for_the_pause_only() {
        let placing = Placing::default();
        let first = placing
            .place("f", "i3", 0, &[0, 1], &HashMap::new())
            .expect("a device");
        assert_eq!(first.ordinal, 0);
        first.short_of_memory();
        drop(first);
        let next = placing
            .place("f", "i4", 0, &[0, 1], &HashMap::new())
            .expect("a device");
        assert_eq!(next.ordinal, 1);
        drop(next);
        // Past the pause, device 0 is a candidate like any other again.
        lock(&placing.state)
            .short_until
            .insert(0, Instant::now() - Duration::from_millis(1));
        let later = placing
            .place("f", "i5", 0, &[0, 1], &HashMap::new())
            .expect("a device");
        assert_eq!(later.ordinal, 0);
    }

    #[test]
    fn a_gpu_a_wake_found_short_is_passed_over_by_the_next_start() {
        // A wake is not placed (it restores where its hibernation was taken): its GPU is
        // marked by ordinal, and the cold start that replaces it goes elsewhere.
        let placing = Placing::default();
        placing.short_of_memory_on(0);
        assert!(placing.any_not_short(&[0, 1]) && !placing.any_not_short(&[0]));
        let next = placing
            .place("f", "i6", 0, &[0, 1], &HashMap::new())
            .expect("a device");
        assert_eq!(next.ordinal, 1);
    }

    #[test]
    fn the_settings_parse_and_refuse_what_they_do_not_know() {
        assert_eq!(Placement::parse("spread"), Some(Placement::Spread));
        assert_eq!(Placement::parse("first"), Some(Placement::First));
        assert_eq!(Placement::parse("random"), None);
        assert_eq!(DriverLanes::parse("gpu"), Some(DriverLanes::Gpu));
        assert_eq!(DriverLanes::parse("node"), Some(DriverLanes::Node));
        assert_eq!(DriverLanes::parse("GPU"), None);
    }

    #[test]
    fn a_start_of_a_function_with_an_instance_live_does_not_lead() {
        let placing = Placing::default();
        let live = placing
            .place("f", "i6", 1, &[0, 1], &HashMap::new())
            .expect("a device");
        assert!(!live.leads);
        let other = placing
            .place("g", "i7", 0, &[0, 1], &HashMap::new())
            .expect("a device");
        assert!(other.leads, "another function's start leads its own burst");
        drop((live, other));
        let again = placing
            .place("g", "i8", 0, &[0, 1], &HashMap::new())
            .expect("a device");
        assert!(
            again.leads,
            "the function's count of starts was not given back"
        );
    }

    #[test]
    fn a_standby_counts_on_its_device_but_never_leads_nor_keeps_a_cold_start_from_leading() {
        let placing = Placing::default();
        let standby = placing
            .place_counted(None, "s", 0, &[0, 1], &HashMap::new())
            .expect("a device");
        assert_eq!(standby.ordinal, 0);
        assert!(!standby.leads);
        let cold = placing
            .place("f", "i9", 0, &[0, 1], &HashMap::new())
            .expect("a device");
        assert_eq!(cold.ordinal, 1, "the standby in flight counts on device 0");
        assert!(cold.leads, "a standby is no start of the burst");
        drop(standby);
        drop(cold);
        assert!(lock(&placing.state).starting.values().all(|&n| n == 0));
        assert!(lock(&placing.state).starting_of.is_empty());
    }

    #[test]
    fn an_instance_in_flight_is_on_its_device_until_its_start_ends() {
        let placing = Placing::default();
        let first = placing
            .place("f", "a", 0, &[0, 1], &HashMap::new())
            .expect("a device");
        let second = placing
            .place("f", "b", 0, &[0, 1], &HashMap::new())
            .expect("a device");
        assert_eq!(
            (placing.device_of("a"), placing.device_of("b")),
            (Some(0), Some(1))
        );
        drop(second);
        assert_eq!(
            placing.device_of("b"),
            None,
            "its pool or placement file says from here"
        );
        assert_eq!(placing.device_of("a"), Some(0));
        drop(first);
        assert!(lock(&placing.state).device_of.is_empty());
    }
}
