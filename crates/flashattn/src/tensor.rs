//! Strided tensors on a device. A tensor is a shared buffer plus shape, strides and offset, so
//! transposes and other views cost no copy: a `[batch, heads, seqlen, head_dim]` buffer is passed to
//! attention as its `[batch, seqlen, heads, head_dim]` view with `transpose(1, 2)`.

use std::borrow::Cow;
use std::sync::Arc;

use half::{bf16, f16};

use crate::cpu::convert::{narrow_bf16, narrow_f16, widen_bf16, widen_f16};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::host_buf::HostBuf;

/// Where a tensor's data lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory; always available.
    Cpu,
    /// An NVIDIA GPU, by ordinal.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A host buffer of one dtype.
#[derive(Clone, Debug)]
pub(crate) enum CpuStorage {
    F32(HostBuf<f32>),
    F16(HostBuf<f16>),
    BF16(HostBuf<bf16>),
}

impl CpuStorage {
    pub(crate) fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
        }
    }

    pub(crate) fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
        }
    }

    /// A buffer of `len` copies of `value`, rounded to `dtype` (see [`HostBuf::filled`]).
    pub(crate) fn filled(dtype: DType, len: usize, value: f32) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(HostBuf::filled(len, value)),
            DType::F16 => CpuStorage::F16(HostBuf::filled(len, f16::from_f32(value))),
            DType::BF16 => CpuStorage::BF16(HostBuf::filled(len, bf16::from_f32(value))),
        }
    }

    pub(crate) fn get_f32(&self, i: usize) -> f32 {
        match self {
            CpuStorage::F32(v) => v[i],
            CpuStorage::F16(v) => v[i].to_f32(),
            CpuStorage::BF16(v) => v[i].to_f32(),
        }
    }
}

/// Typed access to a [`CpuStorage`] for generic kernels.
pub(crate) trait CpuElement: Element {
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
    fn wrap(v: HostBuf<Self>) -> CpuStorage;
    /// `x` itself when `Self` is `f32` (kernels then read it in place), `None` otherwise.
    fn as_f32_slice(x: &[Self]) -> Option<&[f32]>;
    /// Widens `src` into `dst` (equal lengths) a row at a time with the CPU's vector
    /// conversions (`cpu::convert`: f16 by AVX-512 instructions, or F16C through the `half`
    /// crate; bf16 by loops compiled for AVX-512 or AVX2).
    fn widen_into(src: &[Self], dst: &mut [f32]);
    /// Narrows `src` into `dst` (equal lengths), rounding to nearest even, likewise.
    fn narrow_into(src: &[f32], dst: &mut [Self]);
}

macro_rules! cpu_element {
    ($t:ty, $variant:ident, $as_f32:ident, $widen:ident, $narrow:ident) => {
        impl CpuElement for $t {
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(&v[..]),
                    _ => None,
                }
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(&mut v[..]),
                    _ => None,
                }
            }
            fn wrap(v: HostBuf<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
            fn as_f32_slice(x: &[Self]) -> Option<&[f32]> {
                $as_f32(x)
            }
            fn widen_into(src: &[Self], dst: &mut [f32]) {
                $widen(src, dst)
            }
            fn narrow_into(src: &[f32], dst: &mut [Self]) {
                $narrow(src, dst)
            }
        }
    };
}
/// The `as_f32_slice` of the element types that are not `f32`.
fn not_f32<T>(_: &[T]) -> Option<&[f32]> {
    None
}
/// The `widen_into` of f32: a copy.
fn copy_f32(src: &[f32], dst: &mut [f32]) {
    dst.copy_from_slice(src);
}
cpu_element!(f32, F32, Some, copy_f32, copy_f32);
cpu_element!(f16, F16, not_f32, widen_f16, narrow_f16);
cpu_element!(bf16, BF16, not_f32, widen_bf16, narrow_bf16);

/// The buffer behind a tensor.
#[derive(Debug)]
pub(crate) enum Storage {
    Cpu(CpuStorage),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::storage::CudaStorage),
}

/// A strided view of a shared buffer. Cloning is cheap (the buffer is reference counted).
#[derive(Clone, Debug)]
pub struct Tensor {
    storage: Arc<Storage>,
    dtype: DType,
    device: Device,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Row-major strides of `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

/// The most elements a tensor may have: any copy of it (8 bytes an element at most, f64 in the
/// oracle) must fit in an allocation, which is limited to `isize::MAX` bytes.
pub(crate) const MAX_ELEMENTS: usize = isize::MAX as usize / 8;

/// The element count of `shape`, if it is at most [`MAX_ELEMENTS`].
fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= MAX_ELEMENTS)
}

impl Tensor {
    /// A contiguous (row-major) tensor that owns `data` (moved, not copied). The CPU kernels read
    /// fastest from rows that start on 64-byte cache lines; a `Vec` starts wherever the allocator
    /// put it (16 bytes past a line, for large ones), which costs up to 2% (short sequences, the
    /// backward), and on 4 KiB pages, which cost the backward about 1% (see
    /// [`crate::set_huge_pages`]).
    /// [`Tensor::full`], [`Tensor::from_slice`] (a copy), conversions and the outputs of
    /// flashattn start on a line, and from 2 MiB on on a huge page; for a buffer of your own,
    /// [`Tensor::from_vec_strided`] takes an offset into it.
    ///
    /// ```
    /// use flashattn::Tensor;
    /// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// assert_eq!(t.shape(), &[2, 3]);
    /// assert_eq!(t.transpose(0, 1)?.to_vec::<f32>()?, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Self> {
        let strides = contiguous_strides(shape);
        Self::from_vec_strided(data, shape, &strides, 0)
    }

    /// A tensor over `data` with explicit strides (in elements) and offset. Every element the view
    /// can reach must lie inside `data`.
    pub fn from_vec_strided<T: Element>(
        data: Vec<T>,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Self> {
        let storage = to_cpu_storage(HostBuf::Taken(data));
        Self::from_cpu_storage(storage, shape, strides, offset, "data")
    }

    /// A contiguous (row-major) tensor holding a copy of `data`, in a buffer flashattn allocates
    /// the way it does its outputs: starting on a cache line and, from 2 MiB on, on a huge page
    /// (see [`crate::set_huge_pages`]), which the CPU kernels read fastest. Large slices are
    /// copied by all threads.
    ///
    /// ```
    /// use flashattn::Tensor;
    /// let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// assert_eq!(t.transpose(0, 1)?.to_vec::<f32>()?, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Self> {
        let strides = contiguous_strides(shape);
        check_view(data.len(), shape, &strides, 0, "data")?;
        let numel: usize = shape.iter().product();
        let storage = to_cpu_storage(HostBuf::copied(&data[..numel]));
        Self::from_cpu_storage(storage, shape, &strides, 0, "data")
    }

    pub(crate) fn from_cpu_storage(
        storage: CpuStorage,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
        arg: &'static str,
    ) -> Result<Self> {
        check_view(storage.len(), shape, strides, offset, arg)?;
        Ok(Tensor {
            dtype: storage.dtype(),
            storage: Arc::new(Storage::Cpu(storage)),
            device: Device::Cpu,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
        })
    }

    /// A view of a device buffer (every element it can reach must lie inside the buffer).
    #[cfg(feature = "cuda")]
    pub(crate) fn from_cuda_storage(
        storage: crate::cuda::storage::CudaStorage,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Self> {
        check_view(storage.len(), shape, strides, offset, "storage")?;
        Ok(Tensor {
            dtype: storage.dtype(),
            device: Device::Cuda(storage.ordinal()),
            storage: Arc::new(Storage::Cuda(storage)),
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
        })
    }

    /// The whole device buffer behind the view, when the tensor lives on a GPU.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_storage(&self) -> Option<&crate::cuda::storage::CudaStorage> {
        match &*self.storage {
            Storage::Cuda(s) => Some(s),
            Storage::Cpu(_) => None,
        }
    }

    /// The device address of the view's first element (`offset` applied), when on a GPU.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_ptr(&self) -> Option<u64> {
        self.cuda_storage()
            .map(|s| s.device_ptr() + (self.offset * self.dtype.size_in_bytes()) as u64)
    }

    /// The same view (shape and strides) with its buffer copied to `device`. A tensor already
    /// there is returned as is (no copy). Uploading a strided view uploads its buffer from the
    /// view's first element on (at offset 0 on the GPU, where allocations start aligned), so
    /// transposes and other views keep their strides; downloading copies the whole buffer and
    /// keeps the offset.
    ///
    /// ```
    /// use flashattn::{Device, Tensor};
    /// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    /// match t.to_device(Device::Cuda(0)) {
    ///     Ok(g) => assert_eq!(g.to_device(Device::Cpu)?.to_vec::<f32>()?, vec![1.0, 2.0, 3.0, 4.0]),
    ///     Err(e) => println!("no GPU here: {e}"),
    /// }
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device {
            return Ok(self.clone());
        }
        let host = self.host()?;
        // Strides are never negative, so no element of the view lies before `offset`.
        let (storage, offset) = match device {
            Device::Cpu => (Storage::Cpu(host.into_owned()), self.offset),
            Device::Cuda(ordinal) => (Self::upload(&host, self.offset, ordinal)?, 0),
        };
        Ok(Tensor {
            storage: Arc::new(storage),
            device,
            offset,
            ..self.clone()
        })
    }

    /// A device copy of the elements of `host` from `from` on.
    #[cfg(feature = "cuda")]
    fn upload(host: &CpuStorage, from: usize, ordinal: usize) -> Result<Storage> {
        let gpu = crate::cuda::device::gpu(ordinal)?;
        Ok(Storage::Cuda(crate::cuda::storage::CudaStorage::upload(
            &gpu, host, from,
        )?))
    }

    #[cfg(not(feature = "cuda"))]
    fn upload(_host: &CpuStorage, _from: usize, _ordinal: usize) -> Result<Storage> {
        Err(Error::Unsupported {
            device: "cuda",
            what: "this build has no CUDA backend (cargo feature `cuda`)".into(),
        })
    }
}

/// Checks that every element of a view lies inside a buffer of `len` elements.
fn check_view(
    len: usize,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
    arg: &'static str,
) -> Result<()> {
    if strides.len() != shape.len() {
        return Err(Error::arg(
            "strides",
            format!("{} strides (one per dimension)", shape.len()),
            strides.len(),
        ));
    }
    let numel = checked_numel(shape).ok_or_else(|| {
        Error::arg(
            "shape",
            "a shape of at most 2^60 elements",
            format!("{shape:?}"),
        )
    })?;
    if numel > 0 {
        let last = shape.iter().zip(strides).try_fold(offset, |acc, (&d, &s)| {
            (d - 1).checked_mul(s).and_then(|x| x.checked_add(acc))
        });
        match last {
            Some(last) if last < len => {}
            _ => {
                return Err(Error::arg(
                    arg,
                    format!(
                        "a buffer holding shape {shape:?} with strides {strides:?} and offset {offset}"
                    ),
                    format!("{len} elements"),
                ));
            }
        }
    }
    Ok(())
}

impl Tensor {
    /// A contiguous tensor of `shape` with every element `value` (rounded to `dtype`), starting on
    /// a 64-byte cache line (at an offset into its buffer).
    pub fn full(shape: &[usize], dtype: DType, value: f32) -> Result<Self> {
        let numel = checked_numel(shape).ok_or_else(|| {
            Error::arg(
                "shape",
                "a shape of at most 2^60 elements",
                format!("{shape:?}"),
            )
        })?;
        let storage = CpuStorage::filled(dtype, numel, value);
        Self::from_cpu_storage(storage, shape, &contiguous_strides(shape), 0, "shape")
    }

    /// The size of each dimension.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The stride of each dimension, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The element offset of the view's first element in its buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Where the data lives.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when the view is row-major with no gaps.
    pub fn is_contiguous(&self) -> bool {
        self.numel() == 0
            || self
                .shape
                .iter()
                .zip(&self.strides)
                .zip(contiguous_strides(&self.shape))
                .all(|((&d, &s), c)| d == 1 || s == c)
    }

    /// The same data with dimensions `a` and `b` swapped (no copy).
    pub fn transpose(&self, a: usize, b: usize) -> Result<Self> {
        let rank = self.rank();
        for (name, d) in [("dim a", a), ("dim b", b)] {
            if d >= rank {
                return Err(Error::arg(
                    if name == "dim a" { "a" } else { "b" },
                    format!("a dimension index below the rank {rank}"),
                    d,
                ));
            }
        }
        let mut t = self.clone();
        t.shape.swap(a, b);
        t.strides.swap(a, b);
        Ok(t)
    }

    /// Another view of the same buffer (no copy, on any device): `shape` with `strides` (in
    /// elements) starting at element `offset` of the buffer. Every element it reaches must lie
    /// inside the buffer.
    ///
    /// ```
    /// use flashattn::Tensor;
    /// let t = Tensor::from_vec((0..12).map(|i| i as f32).collect::<Vec<_>>(), &[12])?;
    /// let v = t.view(&[2, 3], &[6, 2], 1)?;
    /// assert_eq!(v.to_vec::<f32>()?, vec![1.0, 3.0, 5.0, 7.0, 9.0, 11.0]);
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    pub fn view(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<Tensor> {
        check_view(self.buffer_len(), shape, strides, offset, "self")?;
        Ok(Tensor {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
            ..self.clone()
        })
    }

    /// Elements in the whole buffer behind the view.
    fn buffer_len(&self) -> usize {
        match &*self.storage {
            Storage::Cpu(s) => s.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.len(),
        }
    }

    /// The whole host buffer behind the view (index it with `offset` and `strides`).
    pub(crate) fn cpu_storage(&self) -> Option<&CpuStorage> {
        match &*self.storage {
            Storage::Cpu(s) => Some(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => None,
        }
    }

    /// True when no other tensor (clone or view) shares this one's buffer.
    pub(crate) fn is_exclusive(&mut self) -> bool {
        Arc::get_mut(&mut self.storage).is_some()
    }

    /// The host buffer of a tensor whose buffer is not shared with any other tensor.
    pub(crate) fn cpu_storage_mut(&mut self) -> Option<&mut CpuStorage> {
        match Arc::get_mut(&mut self.storage)? {
            Storage::Cpu(s) => Some(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => None,
        }
    }

    /// The whole host buffer as `T`, when the tensor is on the host and of that type.
    pub(crate) fn cpu_slice<T: CpuElement>(&self) -> Option<&[T]> {
        self.cpu_storage().and_then(T::slice)
    }

    /// Buffer indices of every element, in row-major order of the shape.
    fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        let numel = self.numel();
        let rank = self.rank();
        let mut idx = vec![0usize; rank];
        (0..numel).map(move |n| {
            let at = self.offset
                + idx
                    .iter()
                    .zip(&self.strides)
                    .map(|(i, s)| i * s)
                    .sum::<usize>();
            if n + 1 < numel {
                for d in (0..rank).rev() {
                    idx[d] += 1;
                    if idx[d] < self.shape[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
            at
        })
    }

    /// The whole buffer on the host: borrowed when it lives there, downloaded otherwise.
    fn host(&self) -> Result<Cow<'_, CpuStorage>> {
        match &*self.storage {
            Storage::Cpu(s) => Ok(Cow::Borrowed(s)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Cow::Owned(s.download()?)),
        }
    }

    /// The elements in row-major order of the shape, as `T` (which must be the tensor's dtype).
    /// A tensor on a GPU is downloaded first.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let host = self.host()?;
        if T::DTYPE != self.dtype {
            return Err(Error::DType {
                arg: "T",
                expected: self.dtype.to_string(),
                got: T::DTYPE,
            });
        }
        Ok(self
            .indices()
            .map(|i| T::from_f32(host.get_f32(i)))
            .collect())
    }

    /// The elements in row-major order of the shape, widened to f32 (downloaded first when on a GPU).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let host = self.host()?;
        Ok(self.indices().map(|i| host.get_f32(i)).collect())
    }

    /// The elements in row-major order of the shape, widened to f64.
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        Ok(self.to_f32_vec()?.into_iter().map(f64::from).collect())
    }

    /// A contiguous copy converted to `dtype` (rounding to nearest), on the same device.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let host = self.host()?;
        let (n, widened) = (self.numel(), self.indices().map(|i| host.get_f32(i)));
        let storage = match dtype {
            DType::F32 => CpuStorage::F32(HostBuf::collected(n, widened)),
            DType::F16 => CpuStorage::F16(HostBuf::collected(n, widened.map(f16::from_f32))),
            DType::BF16 => CpuStorage::BF16(HostBuf::collected(n, widened.map(bf16::from_f32))),
        };
        Self::from_cpu_storage(
            storage,
            &self.shape,
            &contiguous_strides(&self.shape),
            0,
            "self",
        )?
        .to_device(self.device)
    }

    /// A contiguous copy (or this tensor, when it already is contiguous).
    pub fn contiguous(&self) -> Result<Self> {
        if self.is_contiguous() && self.offset == 0 {
            return Ok(self.clone());
        }
        self.to_dtype(self.dtype)
    }
}

fn to_cpu_storage<T: Element>(data: HostBuf<T>) -> CpuStorage {
    // Element is implemented for exactly f32, f16 and bf16; each arm moves the buffer without a copy.
    let any: Box<dyn std::any::Any> = Box::new(data);
    match T::DTYPE {
        DType::F32 => CpuStorage::F32(*any.downcast().expect("DTYPE F32 is f32")),
        DType::F16 => CpuStorage::F16(*any.downcast().expect("DTYPE F16 is f16")),
        DType::BF16 => CpuStorage::BF16(*any.downcast().expect("DTYPE BF16 is bf16")),
    }
}
