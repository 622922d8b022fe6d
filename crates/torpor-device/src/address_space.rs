//! What a device has reserved and mapped in this process, so that every operation is checked
//! against it before the kernel or the driver sees it: a bad address is a clear error here, not a
//! `SIGSEGV` in a copy or a bare `CUDA_ERROR_INVALID_VALUE`.

use std::collections::BTreeMap;

use crate::error::DeviceError;
use crate::Access;

/// One reservation and the mappings inside it, keyed by start address.
#[derive(Debug)]
struct Reservation {
    len: usize,
    mappings: BTreeMap<u64, Mapping>,
}

/// A range mapped inside a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mapping {
    pub len: usize,
    pub access: Access,
}

/// The reservations of one device in this process.
#[derive(Debug)]
pub(crate) struct AddressSpace {
    backend: &'static str,
    granularity: usize,
    reservations: BTreeMap<u64, Reservation>,
}

fn end(at: u64, len: usize) -> u64 {
    at.saturating_add(len as u64)
}

impl AddressSpace {
    pub(crate) fn new(backend: &'static str, granularity: usize) -> Self {
        AddressSpace {
            backend,
            granularity,
            reservations: BTreeMap::new(),
        }
    }

    /// Checks that `len` is a non-zero multiple of the granularity.
    pub(crate) fn check_size(&self, what: &'static str, len: usize) -> Result<(), DeviceError> {
        if len == 0 {
            return Err(DeviceError::ZeroSize {
                what,
                granularity: self.granularity,
            });
        }
        self.check_aligned(what, len as u64)
    }

    /// Checks that `value` is a multiple of the granularity.
    pub(crate) fn check_aligned(&self, what: &'static str, value: u64) -> Result<(), DeviceError> {
        if !value.is_multiple_of(self.granularity as u64) {
            return Err(DeviceError::Misaligned {
                backend: self.backend,
                what,
                value,
                granularity: self.granularity,
            });
        }
        Ok(())
    }

    /// Checks a reservation request before it is made.
    pub(crate) fn check_reserve(&self, at: Option<u64>, len: usize) -> Result<(), DeviceError> {
        self.check_size("reservation size", len)?;
        if let Some(at) = at {
            self.check_aligned("reservation address", at)?;
            if at == 0 || at.checked_add(len as u64).is_none() {
                return Err(DeviceError::AddressInUse { at, len });
            }
            let overlaps = self
                .reservations
                .range(..end(at, len))
                .next_back()
                .is_some_and(|(&start, r)| end(start, r.len) > at);
            if overlaps {
                return Err(DeviceError::AddressInUse { at, len });
            }
        }
        Ok(())
    }

    pub(crate) fn add_reservation(&mut self, at: u64, len: usize) {
        self.reservations.insert(
            at,
            Reservation {
                len,
                mappings: BTreeMap::new(),
            },
        );
    }

    /// Forgets the reservation `at..at+len`, which must be exactly one reservation with nothing
    /// mapped in it.
    pub(crate) fn remove_reservation(&mut self, at: u64, len: usize) -> Result<(), DeviceError> {
        match self.reservations.get(&at) {
            Some(r) if r.len == len && r.mappings.is_empty() => {
                self.reservations.remove(&at);
                Ok(())
            }
            Some(r) if r.len == len => Err(DeviceError::StillMapped {
                at,
                mappings: r.mappings.len(),
            }),
            _ => Err(DeviceError::NotReserved { at, len }),
        }
    }

    /// The reservation holding all of `at..at+len`.
    fn reservation_of(&self, at: u64, len: usize) -> Option<&Reservation> {
        let (&start, r) = self.reservations.range(..=at).next_back()?;
        (end(at, len) <= end(start, r.len)).then_some(r)
    }

    fn reservation_of_mut(&mut self, at: u64, len: usize) -> Option<&mut Reservation> {
        let (&start, r) = self.reservations.range_mut(..=at).next_back()?;
        (end(at, len) <= end(start, r.len)).then_some(r)
    }

    /// Checks that `len` bytes may be mapped at `at`: aligned, inside one reservation, over
    /// nothing already mapped.
    pub(crate) fn check_map(&self, at: u64, len: usize) -> Result<(), DeviceError> {
        self.check_size("mapping size", len)?;
        self.check_aligned("mapping address", at)?;
        let reservation = self
            .reservation_of(at, len)
            .ok_or(DeviceError::NotReserved { at, len })?;
        let overlaps = reservation
            .mappings
            .range(..end(at, len))
            .next_back()
            .is_some_and(|(&start, m)| end(start, m.len) > at);
        if overlaps {
            return Err(DeviceError::AlreadyMapped { at, len });
        }
        Ok(())
    }

    /// Records a mapping that [`AddressSpace::check_map`] allowed and that was made.
    pub(crate) fn add_mapping(&mut self, at: u64, len: usize, access: Access) {
        if let Some(r) = self.reservation_of_mut(at, len) {
            r.mappings.insert(at, Mapping { len, access });
        }
    }

    /// The mapping that is exactly `at..at+len`.
    pub(crate) fn mapping(&self, at: u64, len: usize) -> Result<Mapping, DeviceError> {
        self.reservation_of(at, len)
            .and_then(|r| r.mappings.get(&at))
            .filter(|m| m.len == len)
            .copied()
            .ok_or(DeviceError::NotMapped { at, len })
    }

    /// Forgets the mapping that is exactly `at..at+len`.
    pub(crate) fn remove_mapping(&mut self, at: u64, len: usize) -> Result<Mapping, DeviceError> {
        let mapping = self.mapping(at, len)?;
        if let Some(r) = self.reservation_of_mut(at, len) {
            r.mappings.remove(&at);
        }
        Ok(mapping)
    }

    /// Checks that `at..at+len` lies inside one mapping, and that the mapping is writable when
    /// `write` is set.
    pub(crate) fn check_access(&self, at: u64, len: usize, write: bool) -> Result<(), DeviceError> {
        let mapping = self.reservation_of(at, len).and_then(|r| {
            let (&start, m) = r.mappings.range(..=at).next_back()?;
            (end(at, len) <= end(start, m.len)).then_some(*m)
        });
        match mapping {
            None => Err(DeviceError::NotMapped { at, len }),
            Some(m) if write && m.access == Access::ReadOnly => Err(DeviceError::ReadOnly { at }),
            Some(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: usize = 0x1000;

    fn space() -> AddressSpace {
        let mut space = AddressSpace::new("test", G);
        space.add_reservation(0x10000, 8 * G);
        space
    }

    #[test]
    fn sizes_and_addresses_must_be_whole_granules() {
        let space = space();
        assert!(matches!(
            space.check_reserve(None, 0),
            Err(DeviceError::ZeroSize { .. })
        ));
        assert!(matches!(
            space.check_reserve(None, G + 1),
            Err(DeviceError::Misaligned { value: 0x1001, .. })
        ));
        assert!(matches!(
            space.check_map(0x10800, G),
            Err(DeviceError::Misaligned { value: 0x10800, .. })
        ));
        assert!(space.check_reserve(Some(0x40000), 2 * G).is_ok());
    }

    #[test]
    fn reservations_do_not_overlap() {
        let space = space();
        for at in [0x10000, 0x17000, 0xf000] {
            assert!(
                matches!(
                    space.check_reserve(Some(at), 2 * G),
                    Err(DeviceError::AddressInUse { .. })
                ),
                "{at:#x}"
            );
        }
        assert!(space.check_reserve(Some(0x18000), G).is_ok());
        assert!(space.check_reserve(Some(0xe000), 2 * G).is_ok());
    }

    #[test]
    fn mappings_stay_inside_one_reservation_and_do_not_overlap() {
        let mut space = space();
        assert!(matches!(
            space.check_map(0x17000, 2 * G),
            Err(DeviceError::NotReserved { .. })
        ));
        assert!(matches!(
            space.check_map(0x90000, G),
            Err(DeviceError::NotReserved { .. })
        ));
        space.check_map(0x11000, 2 * G).unwrap();
        space.add_mapping(0x11000, 2 * G, Access::ReadOnly);
        for at in [0x10000, 0x12000] {
            assert!(matches!(
                space.check_map(at, 2 * G),
                Err(DeviceError::AlreadyMapped { .. })
            ));
        }
        space.check_map(0x13000, G).unwrap();
        assert!(matches!(
            space.remove_reservation(0x10000, 8 * G),
            Err(DeviceError::StillMapped { mappings: 1, .. })
        ));
        assert!(matches!(
            space.remove_mapping(0x11000, G),
            Err(DeviceError::NotMapped { .. })
        ));
        assert_eq!(
            space.remove_mapping(0x11000, 2 * G).unwrap().access,
            Access::ReadOnly
        );
        space.remove_reservation(0x10000, 8 * G).unwrap();
    }

    #[test]
    fn copies_stay_inside_one_mapping_and_write_only_writable_ones() {
        let mut space = space();
        space.add_mapping(0x10000, 2 * G, Access::ReadWrite);
        space.add_mapping(0x12000, G, Access::ReadOnly);
        space.check_access(0x10010, 100, true).unwrap();
        space.check_access(0x12000, G, false).unwrap();
        assert!(matches!(
            space.check_access(0x12000, 1, true),
            Err(DeviceError::ReadOnly { at: 0x12000 })
        ));
        // Spans two mappings, runs past the last one, or lies in no mapping.
        for (at, len) in [(0x11000, 2 * G), (0x12800, G), (0x14000, 1)] {
            assert!(matches!(
                space.check_access(at, len, false),
                Err(DeviceError::NotMapped { .. })
            ));
        }
    }
}
