//! Where a queue's thread runs (`--queue-placement`).
//!
//! The block layer sends a request to the queue of the CPU that submitted it, and the kernel
//! says which CPUs those are (GET_QUEUE_AFFINITY). A queue's thread that runs on those same
//! CPUs takes turns with the program submitting there: the submitter waits while its
//! requests are served. Elsewhere, the two work side by side, as the kernel's loop device
//! does with its worker threads, which run on any CPU. Measured in the VM lab (2 vCPUs, a raw
//! file on ext4 with O_DIRECT, fio at iodepth 32): a queue's thread kept to its own CPU gave
//! about half the IOPS of one kept off it, and one the scheduler placed freely about 0.9x.
//! `own` is for machines where every CPU submits and each should serve its own.

use rustix::thread::CpuSet;

/// Where each queue's thread may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// On the CPUs this process may use, except those whose requests the queue serves (all
    /// of them where that leaves none).
    #[default]
    Elsewhere,
    /// On the CPUs whose requests the queue serves (what ublksrv does).
    Own,
    /// Wherever the scheduler puts it.
    Any,
}

impl Placement {
    /// From its name on the command line.
    pub fn named(name: &str) -> Option<Placement> {
        match name {
            "elsewhere" => Some(Placement::Elsewhere),
            "own" => Some(Placement::Own),
            "any" => Some(Placement::Any),
            _ => None,
        }
    }

    /// Its name, for the log.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Elsewhere => "elsewhere",
            Placement::Own => "own",
            Placement::Any => "any",
        }
    }

    /// The CPUs a queue's thread is kept to, given the queue's CPUs (`served`) and the
    /// process's (`allowed`); `None`: leave it where it may run now.
    pub fn cpus(self, served: &CpuSet, allowed: &CpuSet) -> Option<CpuSet> {
        let mut cpus = CpuSet::new();
        for cpu in 0..CpuSet::MAX_CPU {
            let keep = match self {
                Placement::Any => return None,
                Placement::Elsewhere => allowed.is_set(cpu) && !served.is_set(cpu),
                Placement::Own => allowed.is_set(cpu) && served.is_set(cpu),
            };
            if keep {
                cpus.set(cpu);
            }
        }
        (cpus.count() > 0 && cpus != *allowed).then_some(cpus)
    }
}

/// The CPUs set in `mask`, the kernel's cpumask (bit N of byte N / 8).
pub fn cpus_of_mask(mask: &[u8]) -> CpuSet {
    let mut cpus = CpuSet::new();
    for (i, byte) in mask.iter().enumerate() {
        for bit in 0..8 {
            let cpu = i * 8 + bit;
            if byte & (1 << bit) != 0 && cpu < CpuSet::MAX_CPU {
                cpus.set(cpu);
            }
        }
    }
    cpus
}

/// `cpus` as a list for the log ("0,2-3").
pub fn cpu_list(cpus: &CpuSet) -> String {
    let mut parts = Vec::new();
    let mut cpu = 0;
    while cpu < CpuSet::MAX_CPU {
        if !cpus.is_set(cpu) {
            cpu += 1;
            continue;
        }
        let first = cpu;
        while cpu + 1 < CpuSet::MAX_CPU && cpus.is_set(cpu + 1) {
            cpu += 1;
        }
        parts.push(match first == cpu {
            true => first.to_string(),
            false => format!("{first}-{cpu}"),
        });
        cpu += 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(cpus: &[usize]) -> CpuSet {
        let mut s = CpuSet::new();
        for &c in cpus {
            s.set(c);
        }
        s
    }

    #[test]
    fn elsewhere_keeps_a_queue_off_the_cpus_it_serves() {
        let allowed = set(&[0, 1, 2, 3]);
        let cpus = Placement::Elsewhere.cpus(&set(&[1]), &allowed).unwrap();
        assert_eq!(cpu_list(&cpus), "0,2-3");
        // A queue serving every CPU it may use stays where it may run.
        assert!(Placement::Elsewhere.cpus(&allowed, &allowed).is_none());
        // Nor does a CPU outside the process's set get used.
        let cpus = Placement::Elsewhere
            .cpus(&set(&[0]), &set(&[0, 3]))
            .unwrap();
        assert_eq!(cpu_list(&cpus), "3");
    }

    #[test]
    fn own_and_any() {
        let allowed = set(&[0, 1]);
        let cpus = Placement::Own.cpus(&set(&[1]), &allowed).unwrap();
        assert_eq!(cpu_list(&cpus), "1");
        assert!(Placement::Own.cpus(&set(&[5]), &allowed).is_none());
        assert!(Placement::Any.cpus(&set(&[1]), &allowed).is_none());
        for p in [Placement::Elsewhere, Placement::Own, Placement::Any] {
            assert_eq!(Placement::named(p.name()), Some(p));
        }
        assert_eq!(Placement::named("near"), None);
    }

    #[test]
    fn the_kernels_mask_is_read_bit_by_bit() {
        let cpus = cpus_of_mask(&[0b0000_0101, 0, 0b1000_0000, 0, 0, 0, 0, 0]);
        assert_eq!(cpu_list(&cpus), "0,2,23");
        assert_eq!(cpu_list(&cpus_of_mask(&[0xff; 2])), "0-15");
        assert_eq!(cpu_list(&cpus_of_mask(&[0; 128])), "");
    }
}
