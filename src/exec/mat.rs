//! A row-major matrix: activations, and weights as dequantized before a backend holds them.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, OnceLock};

use anyhow::{bail, Result};

use crate::exec::real::Real;
use crate::trace::stats::StatsLater;

/// The values are shared, copied on write: a clone, or a stage handed to the trace writer for
/// its statistics, costs no copy until one side changes them. A backend's output may leave its
/// values where they were made (a GPU) until something on the host reads them.
#[derive(Clone)]
pub struct Mat<E = f32> {
    pub rows: usize,
    pub cols: usize,
    /// Shared by clones, so that values fetched for one are there for all.
    data: Arc<OnceLock<Arc<Vec<E>>>>,
    twin: Twin,
}

/// Values a backend holds elsewhere (a GPU's output buffer), equal to the host's: the next op
/// on that device reads them instead of an upload, and the host fetches them only when it
/// reads them.
pub trait Remote: Any + Send + Sync {
    /// The values, brought to the host as f32.
    fn fetch(&self) -> Result<Vec<f32>>;
    /// Their statistics and content hash, those of the fetched values: started where the
    /// values are, finished when called for (the values held until then); `None` where
    /// fetching them and taking the statistics on the host costs less (a small matrix).
    fn stats(self: Arc<Self>) -> Result<Option<StatsLater>>;
    /// The values as [`Self::fetch`] gives them, from a copy queued now (where `queue` says)
    /// and waited for when called (the values held until then); `None` where the twin cannot
    /// queue one.
    fn fetch_later(self: Arc<Self>, _queue: Queue) -> Result<Option<FetchLater>> {
        Ok(None)
    }
}

/// Where a copy for later waits on a device that takes statistics beside the forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Queue {
    /// In the forward's own order, behind the op that made the values: a copy the forward
    /// itself waits for (the router's logits), which must not wait for the statistics queued
    /// beside it as well (at 512 tokens those held each MoE layer's routing for milliseconds).
    Forward,
    /// Beside the forward, behind the statistics queued there so far: a copy that only the
    /// trace's writer or a helper thread waits for.
    Beside,
}

/// Values on their way to the host: waited for when called.
pub type FetchLater = Box<dyn FnOnce() -> Result<Vec<f32>> + Send>;

/// A matrix's values, ready when called: see [`Mat::values_later`].
pub type ValuesLater<E> = Box<dyn FnOnce() -> Result<Arc<Vec<E>>> + Send>;

/// The same values held elsewhere by the backend that produced them. Only values equal to the
/// host's; any mutable access to the host's values drops it, so the two never disagree.
#[derive(Clone, Default)]
struct Twin(Option<Arc<dyn Remote>>);

impl fmt::Debug for Twin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "twin" } else { "-" })
    }
}

impl<E: Real> fmt::Debug for Mat<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mat")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("data", &self.data.get())
            .field("twin", &self.twin)
            .finish()
    }
}

/// Twins hold the host's values, so only the values make two matrices differ.
impl<E: Real> PartialEq for Mat<E> {
    fn eq(&self, other: &Mat<E>) -> bool {
        (self.rows, self.cols) == (other.rows, other.cols) && self.data() == other.data()
    }
}

impl<E: Real> Mat<E> {
    /// Panics when `data` does not hold `rows × cols` values: callers size both.
    pub fn new(rows: usize, cols: usize, data: Vec<E>) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "matrix data does not match {rows}×{cols}"
        );
        Mat {
            rows,
            cols,
            data: Arc::new(OnceLock::from(Arc::new(data))),
            twin: Twin::default(),
        }
    }

    /// A matrix whose values are only held by `twin` for now, fetched when the host first
    /// reads them.
    pub fn remote<T: Remote>(rows: usize, cols: usize, twin: T) -> Self {
        Mat {
            rows,
            cols,
            data: Arc::default(),
            twin: Twin(Some(Arc::new(twin))),
        }
    }

    /// How many values: `rows × cols`.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values, row-major; fetched from the twin the first time where they were left there.
    ///
    /// Panics where that fetch fails (the device is lost): [`Self::fetched`] returns the error.
    pub fn data(&self) -> &[E] {
        match self.fetched() {
            Ok(data) => data,
            Err(e) => panic!("a {}×{} matrix's values: {e:#}", self.rows, self.cols),
        }
    }

    /// [`Self::data`], a failed fetch an error.
    pub fn fetched(&self) -> Result<&[E]> {
        Ok(self.shared()?.as_slice())
    }

    fn shared(&self) -> Result<&Arc<Vec<E>>> {
        if let Some(data) = self.data.get() {
            return Ok(data);
        }
        let Some(twin) = &self.twin.0 else {
            bail!("no values and no twin");
        };
        let values = E::widen_all(twin.fetch()?);
        if values.len() != self.len() {
            bail!(
                "{} values fetched for {}×{}",
                values.len(),
                self.rows,
                self.cols
            );
        }
        // Another clone may have fetched them meanwhile: either copy is the same.
        Ok(self.data.get_or_init(|| Arc::new(values)))
    }

    /// Whether the host holds the values (else only the twin does, until they are read).
    pub fn on_host(&self) -> bool {
        self.data.get().is_some()
    }

    /// The statistics of values the host has not fetched, computed where they are (to be
    /// finished when needed); `None` where the host holds them or the twin would rather they
    /// were fetched.
    pub fn remote_stats(&self) -> Result<Option<StatsLater>> {
        match (&self.twin.0, self.on_host()) {
            (Some(twin), false) => twin.clone().stats(),
            _ => Ok(None),
        }
    }

    /// The values, for work that can wait: where only the twin holds them and can queue a
    /// copy, it is queued now (where `queue` says) and waited for when called, so that neither
    /// the host nor the twin's device waits now; else the host's (fetched now where needed).
    pub fn values_later(&self, queue: Queue) -> Result<ValuesLater<E>> {
        if let (Some(twin), false) = (&self.twin.0, self.on_host()) {
            if let Some(later) = twin.clone().fetch_later(queue)? {
                let len = self.len();
                return Ok(Box::new(move || {
                    let values = later()?;
                    if values.len() != len {
                        bail!("{} values fetched for {len}", values.len());
                    }
                    Ok(Arc::new(E::widen_all(values)))
                }));
            }
        }
        let values = self.shared()?.clone();
        Ok(Box::new(move || Ok(values)))
    }

    /// The values to change in place, not in number (their twin, if any, dropped; copied first
    /// where they are shared).
    pub fn data_mut(&mut self) -> &mut [E] {
        self.data();
        self.twin = Twin::default();
        let cell = Arc::make_mut(&mut self.data);
        Arc::make_mut(cell.get_mut().expect("fetched above")).as_mut_slice()
    }

    /// The values, copied only where they are shared.
    pub fn into_data(self) -> Vec<E> {
        self.data();
        let cell = Arc::unwrap_or_clone(self.data);
        Arc::unwrap_or_clone(cell.into_inner().expect("fetched above"))
    }

    /// The values, shared (for the trace writer); fetched first where they were left with the
    /// twin.
    pub fn shared_data(&self) -> Result<Arc<Vec<E>>> {
        self.shared().cloned()
    }

    /// The matrix with `twin` beside its values: the backend's own copy of exactly these values.
    pub fn with_twin<T: Remote>(mut self, twin: T) -> Self {
        self.twin = Twin(Some(Arc::new(twin)));
        self
    }

    /// The twin beside the values, if one of type `T` is there.
    pub fn twin<T: Any>(&self) -> Option<&T> {
        let twin: &dyn Any = self.twin.0.as_deref()?;
        twin.downcast_ref()
    }

    pub fn zeros(rows: usize, cols: usize) -> Self {
        Mat::new(rows, cols, vec![E::zero(); rows * cols])
    }

    /// A 2-D weight of row-major `shape`.
    pub fn from_shape(data: Vec<E>, shape: &[u64]) -> Result<Self> {
        match shape {
            [r, c] => Ok(Mat::new(*r as usize, *c as usize, data)),
            _ => bail!("shape {shape:?} is not a matrix"),
        }
    }

    pub fn row(&self, r: usize) -> &[E] {
        &self.data()[r * self.cols..(r + 1) * self.cols]
    }

    pub fn row_mut(&mut self, r: usize) -> &mut [E] {
        let cols = self.cols;
        &mut self.data_mut()[r * cols..(r + 1) * cols]
    }

    /// Rows `rows` of the matrix, in that order.
    pub fn gather_rows(&self, rows: &[usize]) -> Mat<E> {
        let mut data = Vec::with_capacity(rows.len() * self.cols);
        for &r in rows {
            data.extend_from_slice(self.row(r));
        }
        Mat::new(rows.len(), self.cols, data)
    }

    /// Columns `start..start+len` of every row.
    pub fn columns(&self, start: usize, len: usize) -> Mat<E> {
        let data = (0..self.rows)
            .flat_map(|r| self.row(r)[start..start + len].iter().copied())
            .collect();
        Mat::new(self.rows, len, data)
    }

    /// Every value through `f`, e.g. into another number type.
    pub fn map<F: Real>(&self, f: impl Fn(E) -> F) -> Mat<F> {
        Mat::new(
            self.rows,
            self.cols,
            self.data().iter().map(|&v| f(v)).collect(),
        )
    }

    /// Element-wise sum.
    pub fn add(&self, other: &Mat<E>) -> Mat<E> {
        let data = self
            .data()
            .iter()
            .zip(other.data())
            .map(|(&a, &b)| a + b)
            .collect();
        Mat::new(self.rows, self.cols, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::stats::TensorStats;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Values held "elsewhere", counting its fetches.
    struct Elsewhere(Vec<f32>, Arc<AtomicUsize>);

    impl Remote for Elsewhere {
        fn fetch(&self) -> Result<Vec<f32>> {
            self.1.fetch_add(1, Ordering::SeqCst);
            Ok(self.0.clone())
        }
        fn stats(self: Arc<Self>) -> Result<Option<StatsLater>> {
            let stats = TensorStats::of(&self.0);
            Ok(Some(Box::new(move || Ok(stats))))
        }
        fn fetch_later(self: Arc<Self>, _: Queue) -> Result<Option<FetchLater>> {
            Ok(Some(Box::new(move || self.fetch())))
        }
    }

    /// Values for later come from a twin that can queue a copy, fetched when called and not
    /// before, and never kept on the host; from the host's values where it holds them; a twin
    /// whose copy has another length is an error, not a short matrix.
    #[test]
    fn values_for_later_are_fetched_when_called() {
        let values = [0.5f32, -1.0, 2.0, 7.0];
        let (twin, fetches) = elsewhere(&values);
        let m = Mat::<f64>::remote(2, 2, twin);
        let later = m.values_later(Queue::Forward).unwrap();
        assert_eq!(fetches.load(Ordering::SeqCst), 0, "nothing fetched yet");
        assert_eq!(*later().unwrap(), vec![0.5f64, -1.0, 2.0, 7.0]);
        assert_eq!(fetches.load(Ordering::SeqCst), 1);
        assert!(
            !m.on_host(),
            "a copy for later leaves the host's values unfetched"
        );

        let on_host = Mat::new(1, 2, vec![3.0f32, 4.0]).with_twin(elsewhere(&[3.0, 4.0]).0);
        assert_eq!(
            *on_host.values_later(Queue::Beside).unwrap()().unwrap(),
            vec![3.0f32, 4.0]
        );

        let (short, _) = elsewhere(&values[..3]);
        let wrong = Mat::<f32>::remote(2, 2, short)
            .values_later(Queue::Beside)
            .unwrap();
        let err = wrong().unwrap_err().to_string();
        assert!(err.contains("3 values fetched for 4"), "{err}");
    }

    fn elsewhere(values: &[f32]) -> (Elsewhere, Arc<AtomicUsize>) {
        let fetches = Arc::new(AtomicUsize::new(0));
        (Elsewhere(values.to_vec(), fetches.clone()), fetches)
    }

    /// A twin lives only while the values it stands for do: a clone keeps it, every way to
    /// change the values drops it; values shared with another holder are copied before a change.
    #[test]
    fn a_change_drops_the_twin_and_leaves_shared_values_alone() {
        let values = [1.0f32, 2.0, 3.0, 4.0];
        let m = Mat::new(2, 2, values.to_vec()).with_twin(elsewhere(&values).0);
        assert!(m.twin::<Elsewhere>().is_some());
        assert!(m.twin::<u16>().is_none(), "another type is not the twin");
        assert!(
            m.remote_stats().unwrap().is_none(),
            "the host holds the values"
        );
        let clone = m.clone();
        assert!(clone.twin::<Elsewhere>().is_some());

        let shared = m.shared_data().unwrap();
        let mut changed = m.clone();
        changed.data_mut()[0] = 9.0;
        assert!(changed.twin::<Elsewhere>().is_none());
        assert_eq!(changed.data(), &[9.0, 2.0, 3.0, 4.0]);
        assert_eq!(shared.as_slice(), &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m.data(), &[1.0, 2.0, 3.0, 4.0]);

        let mut by_row = m.clone();
        by_row.row_mut(1)[1] = 0.5;
        assert!(by_row.twin::<Elsewhere>().is_none());
        assert!(
            m.twin::<Elsewhere>().is_some(),
            "the original keeps its twin"
        );

        assert_eq!(
            m.gather_rows(&[1, 0, 1]).data(),
            &[3.0, 4.0, 1.0, 2.0, 3.0, 4.0]
        );
        assert!(
            m.gather_rows(&[1]).twin::<Elsewhere>().is_none(),
            "picked rows have no twin"
        );
    }

    /// Values left with the twin are fetched once, when first read, for every clone; until
    /// then their statistics come from the twin; a change fetches them first.
    #[test]
    fn remote_values_are_fetched_once_when_read() {
        let values = [0.5f32, -1.0, 2.0];
        let (twin, fetches) = elsewhere(&values);
        let m = Mat::<f32>::remote(1, 3, twin);
        let clone = m.clone();
        assert!(!m.on_host());
        let later = m.remote_stats().unwrap().expect("left with the twin");
        let stats = later().unwrap();
        assert_eq!(stats, TensorStats::of(&values));
        assert_eq!(
            fetches.load(Ordering::SeqCst),
            0,
            "statistics fetch nothing"
        );
        assert_eq!(clone.data(), &values);
        assert_eq!(m.data(), &values);
        assert_eq!(
            fetches.load(Ordering::SeqCst),
            1,
            "one fetch for both clones"
        );
        assert!(m.remote_stats().unwrap().is_none(), "the host's values now");

        let (twin, fetches) = elsewhere(&values);
        let mut changed = Mat::<f32>::remote(1, 3, twin);
        changed.data_mut()[2] = 7.0;
        assert_eq!(changed.data(), &[0.5, -1.0, 7.0]);
        assert!(changed.twin::<Elsewhere>().is_none());
        assert_eq!(fetches.load(Ordering::SeqCst), 1);

        let (twin, _) = elsewhere(&values);
        let wrong = Mat::<f32>::remote(2, 2, twin);
        let err = wrong.fetched().unwrap_err().to_string();
        assert!(err.contains("3 values fetched for 2×2"), "{err}");
    }
}
