//! numpy's `.npy` format (one array: a magic string, a header dict, raw data), as held in
//! `.npz` archives. Little-endian C-order arrays of f4, f2 and i4 are read and written; anything
//! else is reported by its numpy type string.

use super::tensor_files::Data;

const MAGIC: &[u8] = b"\x93NUMPY";

/// The numpy type string (`descr`) of a dtype we write.
fn descr(data: &Data) -> Option<&'static str> {
    match data {
        Data::F32(_) => Some("<f4"),
        Data::F16(_) => Some("<f2"),
        Data::I32(_) => Some("<i4"),
        Data::BF16(_) | Data::Other(_) => None,
    }
}

/// Parses one `.npy` file: its shape and data. Errors are plain messages (the caller names the
/// file and the array).
pub fn parse(bytes: &[u8]) -> Result<(Vec<usize>, Data), String> {
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err("not a .npy array (no \\x93NUMPY magic)".into());
    }
    let major = bytes[6];
    let (len, start) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        _ => return Err(format!("unsupported .npy version {major}")),
    };
    let header = bytes
        .get(start..start + len)
        .ok_or("truncated .npy header")?;
    let header = std::str::from_utf8(header).map_err(|_| "the .npy header is not text")?;
    let descr = field(header, "descr")
        .map(|v| v.trim_matches(|c| c == '\'' || c == '"').to_string())
        .ok_or("the .npy header has no descr")?;
    if field(header, "fortran_order").is_some_and(|v| v.starts_with("True")) {
        return Err(
            "Fortran-ordered array (save it C-contiguous, e.g. with np.ascontiguousarray)".into(),
        );
    }
    let shape = parse_shape(header)?;
    let n = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or("shape too large")?;
    let body = &bytes[start + len..];
    let take = |size: usize| -> Result<&[u8], String> {
        let need = n.checked_mul(size).ok_or("shape too large")?;
        body.get(..need).ok_or_else(|| {
            format!(
                "truncated data: {} bytes for {n} elements of {size} bytes",
                body.len()
            )
        })
    };
    let data = match descr.as_str() {
        "<f4" | "=f4" => Data::F32(
            take(4)?
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        "<f2" | "=f2" => Data::F16(
            take(2)?
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        "<i4" | "=i4" => Data::I32(
            take(4)?
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        other => Data::Other(format!("numpy {other}")),
    };
    Ok((shape, data))
}

/// The raw text of `key`'s value in a header dict such as
/// `{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }`.
fn field<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header
        .find(&format!("'{key}'"))
        .or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = &header[at + key.len() + 2..];
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    let end = if rest.starts_with('(') {
        rest.find(')')? + 1
    } else {
        rest.find([',', '}'])?
    };
    Some(rest[..end].trim())
}

fn parse_shape(header: &str) -> Result<Vec<usize>, String> {
    let raw = field(header, "shape").ok_or("the .npy header has no shape")?;
    raw.trim_matches(|c| c == '(' || c == ')')
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.trim_end_matches('L')
                .parse()
                .map_err(|_| format!("bad shape {raw}"))
        })
        .collect()
}

/// The `.npy` bytes of an array (format version 1.0, little-endian, C order).
pub fn write(shape: &[usize], data: &Data) -> Result<Vec<u8>, String> {
    let descr = descr(data).ok_or_else(|| {
        format!(
            "{} cannot be stored in .npy/.npz (numpy has no such dtype): write .safetensors instead",
            data.dtype_name()
        )
    })?;
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Pad with spaces so that magic + version + length + header + '\n' is a multiple of 64.
    let unpadded = MAGIC.len() + 2 + 2 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let len = u16::try_from(header.len()).map_err(|_| "header too long")?;
    let mut out = Vec::with_capacity(header.len() + 16 + data.byte_len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    data.extend_le_bytes(&mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_shape_and_values() {
        let data = Data::F32(vec![1.0, -2.5, 3.25, 0.0, 7.0, 8.5]);
        let bytes = write(&[2, 3], &data).unwrap();
        assert_eq!((bytes.len() - 6 * 4) % 64, 0);
        let (shape, back) = parse(&bytes).unwrap();
        assert_eq!(shape, vec![2, 3]);
        match back {
            Data::F32(v) => assert_eq!(v, vec![1.0, -2.5, 3.25, 0.0, 7.0, 8.5]),
            _ => panic!("wrong dtype"),
        }
        let bytes = write(&[3], &Data::I32(vec![0, 5, 9])).unwrap();
        let (shape, back) = parse(&bytes).unwrap();
        assert_eq!(shape, vec![3]);
        assert!(matches!(back, Data::I32(v) if v == vec![0, 5, 9]));
    }

    #[test]
    fn unsupported_arrays_are_named_not_misread() {
        let with = |header: &str| {
            let mut b = MAGIC.to_vec();
            b.extend_from_slice(&[1, 0]);
            b.extend_from_slice(&(header.len() as u16).to_le_bytes());
            b.extend_from_slice(header.as_bytes());
            b.extend_from_slice(&[0u8; 64]);
            b
        };
        let big = with("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }\n");
        assert!(matches!(parse(&big).unwrap().1, Data::Other(d) if d == "numpy >f4"));
        let f64s = with("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }\n");
        assert!(matches!(parse(&f64s).unwrap().1, Data::Other(d) if d == "numpy <f8"));
        let fortran = with("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }\n");
        assert!(parse(&fortran).unwrap_err().contains("Fortran"));
        let short = with("{'descr': '<f4', 'fortran_order': False, 'shape': (100,), }\n");
        assert!(parse(&short).unwrap_err().contains("truncated"));
        assert!(parse(b"PK\x03\x04 not npy").is_err());
    }

    #[test]
    fn header_fields_are_found() {
        let h = "{'descr': '<f8', 'fortran_order': False, 'shape': (4, 5), }";
        assert_eq!(field(h, "descr"), Some("'<f8'"));
        assert_eq!(parse_shape(h).unwrap(), vec![4, 5]);
        assert_eq!(parse_shape("{'shape': (), }").unwrap(), Vec::<usize>::new());
    }
}
