//! PostGIS values → Meilisearch's geo fields.
//!
//! The column a task names in its `geo` option reaches the encoder as PostGIS's text output: hex
//! EWKB (`geometry_out`, `geography_out`). A point becomes `_geo: {"lat", "lng"}`, which
//! `_geoRadius`, `_geoBoundingBox` and `_geoPoint(…)` sorting use; any other geometry becomes
//! `_geojson` (a GeoJSON geometry), which `_geoPolygon` and `_geoBoundingBox` filter. Meilisearch
//! reads both as WGS 84 longitude/latitude, so a value in another SRID, without one, or with a
//! coordinate outside ±180° / ±90° cannot be sent: it is a dead letter with the reason, never a
//! batch Meilisearch fails (a bad geo field fails every task of the batch it lands in).

use serde_json::{json, Map, Value};

/// The SRID of WGS 84 longitude/latitude, the only one Meilisearch understands.
pub const WGS84: u32 = 4326;

/// The document field of a point.
pub const POINT_FIELD: &str = "_geo";

/// The document field of any other geometry.
pub const SHAPE_FIELD: &str = "_geojson";

/// Why a PostGIS value cannot be a geo field; its text is the reason a dead letter gives.
#[derive(Debug, Clone, PartialEq)]
pub enum GeoError {
    /// Not hex EWKB; holds the value's first characters.
    NotEwkb(String),
    EndsEarly,
    /// Bytes left over after the geometry.
    TrailingBytes(usize),
    TooDeep,
    ByteOrder(u8),
    /// An SRID other than WGS 84's.
    Srid(u32),
    NoSrid,
    /// A member of a multi-geometry of another type (the collection's WKB type).
    MemberMismatch(u32),
    /// A geometry type GeoJSON has no form for (its WKB type).
    NoGeoJson(u32),
    Longitude(f64),
    Latitude(f64),
}

impl std::fmt::Display for GeoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GeoError::NotEwkb(start) => write!(f, "expected PostGIS's hex EWKB output, got {start:?}"),
            GeoError::EndsEarly => f.write_str("the EWKB value ends early"),
            GeoError::TrailingBytes(count) => write!(f, "{count} bytes follow the geometry"),
            GeoError::TooDeep => write!(f, "collections nested deeper than {MAX_DEPTH}"),
            GeoError::ByteOrder(byte) => write!(f, "unknown EWKB byte order {byte}"),
            GeoError::Srid(srid) => write!(
                f,
                "SRID {srid}: Meilisearch reads WGS 84 longitude/latitude (SRID {WGS84}); store the value with ST_Transform(…, {WGS84})"
            ),
            GeoError::NoSrid => write!(
                f,
                "the value has no SRID: Meilisearch reads WGS 84 longitude/latitude; store it with ST_SetSRID(…, {WGS84})"
            ),
            GeoError::MemberMismatch(kind) => {
                write!(f, "a member of a {} does not fit it", type_name(*kind))
            }
            GeoError::NoGeoJson(kind) => write!(
                f,
                "{} has no GeoJSON form; store it with ST_CurveToLine or as a simpler geometry",
                type_name(*kind)
            ),
            GeoError::Longitude(lng) => write!(
                f,
                "longitude {lng} is outside [-180, 180] (is the value in longitude, latitude order?)"
            ),
            GeoError::Latitude(lat) => write!(
                f,
                "latitude {lat} is outside [-90, 90] (is the value in longitude, latitude order?)"
            ),
        }
    }
}

/// What one PostGIS value becomes.
#[derive(Debug, Clone, PartialEq)]
pub enum GeoValue {
    /// `POINT EMPTY` (or an empty collection): no location, `_geo: null`.
    Empty,
    Point {
        lat: f64,
        lng: f64,
    },
    /// A GeoJSON geometry object for `_geojson`.
    Shape(Value),
}

impl GeoValue {
    /// The document field this value is written to.
    pub fn field(&self) -> &'static str {
        match self {
            GeoValue::Shape(_) => SHAPE_FIELD,
            GeoValue::Empty | GeoValue::Point { .. } => POINT_FIELD,
        }
    }

    /// Appends the field's JSON value.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        let value = match self {
            GeoValue::Empty => Value::Null,
            GeoValue::Point { lat, lng } => json!({"lat": lat, "lng": lng}),
            GeoValue::Shape(shape) => shape.clone(),
        };
        // Writing a Value into a Vec cannot fail: every number in it is finite.
        let _ = serde_json::to_writer(out, &value);
    }
}

/// Reads PostGIS's text output (hex EWKB) of a geometry or geography. The error is the reason
/// the row is a dead letter.
pub fn from_postgis_text(text: &str) -> Result<GeoValue, GeoError> {
    let bytes =
        decode_hex(text).ok_or_else(|| GeoError::NotEwkb(text.chars().take(40).collect()))?;
    let mut reader = Reader {
        bytes: &bytes,
        position: 0,
        little_endian: true,
    };
    let geometry = reader.geometry(0, true)?;
    if reader.position != bytes.len() {
        return Err(GeoError::TrailingBytes(bytes.len() - reader.position));
    }
    Ok(match geometry {
        Geometry::Point(None) => GeoValue::Empty,
        Geometry::Point(Some([lng, lat])) => GeoValue::Point { lat, lng },
        Geometry::Collection { ref members, .. } if members.is_empty() => GeoValue::Empty,
        other => GeoValue::Shape(other.to_geojson()),
    })
}

/// Whether a column's declared type (`format_type` output such as `geometry(Point,4326)`) only
/// holds points, so that its documents only ever carry `_geo`.
pub fn declared_points_only(type_name: &str) -> bool {
    let Some((_, modifier)) = type_name.split_once('(') else {
        return false;
    };
    let subtype = modifier
        .split([',', ')'])
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    subtype.starts_with("point")
}

/// The settings a geo task needs on its index, given the index's current settings: `_geo`
/// filterable and sortable, `_geojson` filterable. None when they are set already. Entries the
/// user set stay; only what is missing is added.
pub fn missing_geo_settings(current: &Value) -> Option<Value> {
    let mut patch = Map::new();
    for (setting, fields) in [
        ("filterableAttributes", &[POINT_FIELD, SHAPE_FIELD][..]),
        ("sortableAttributes", &[POINT_FIELD][..]),
    ] {
        let mut entries = current
            .get(setting)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let mut changed = false;
        for field in fields {
            if !entries.iter().any(|entry| entry.as_str() == Some(field)) {
                entries.push(Value::String((*field).to_string()));
                changed = true;
            }
        }
        if changed {
            patch.insert(setting.to_string(), Value::Array(entries));
        }
    }
    (!patch.is_empty()).then_some(Value::Object(patch))
}

const WKB_POINT: u32 = 1;
const WKB_LINE_STRING: u32 = 2;
const WKB_POLYGON: u32 = 3;
const WKB_MULTI_POINT: u32 = 4;
const WKB_MULTI_LINE_STRING: u32 = 5;
const WKB_MULTI_POLYGON: u32 = 6;
const WKB_COLLECTION: u32 = 7;

const EWKB_Z: u32 = 0x8000_0000;
const EWKB_M: u32 = 0x4000_0000;
const EWKB_SRID: u32 = 0x2000_0000;

/// Nesting of collections beyond which a value is refused rather than read recursively.
const MAX_DEPTH: usize = 32;

type Position = [f64; 2];

enum Geometry {
    /// None for `POINT EMPTY`.
    Point(Option<Position>),
    LineString(Vec<Position>),
    Polygon(Vec<Vec<Position>>),
    Collection {
        kind: u32,
        members: Vec<Geometry>,
    },
}

impl Geometry {
    fn to_geojson(&self) -> Value {
        let positions = |line: &[Position]| -> Value { line.iter().map(|p| json!(p)).collect() };
        match self {
            Geometry::Point(point) => json!({"type": "Point", "coordinates": point}),
            Geometry::LineString(line) => {
                json!({"type": "LineString", "coordinates": positions(line)})
            }
            Geometry::Polygon(rings) => json!({
                "type": "Polygon",
                "coordinates": rings.iter().map(|ring| positions(ring)).collect::<Vec<_>>(),
            }),
            Geometry::Collection { kind, members } => {
                let coordinates = |member: &Geometry| match member {
                    Geometry::Point(point) => json!(point),
                    Geometry::LineString(line) => positions(line),
                    Geometry::Polygon(rings) => rings.iter().map(|ring| positions(ring)).collect(),
                    Geometry::Collection { .. } => Value::Null,
                };
                match *kind {
                    WKB_MULTI_POINT => json!({"type": "MultiPoint",
                        "coordinates": members.iter().map(coordinates).collect::<Vec<_>>()}),
                    WKB_MULTI_LINE_STRING => json!({"type": "MultiLineString",
                        "coordinates": members.iter().map(coordinates).collect::<Vec<_>>()}),
                    WKB_MULTI_POLYGON => json!({"type": "MultiPolygon",
                        "coordinates": members.iter().map(coordinates).collect::<Vec<_>>()}),
                    _ => json!({"type": "GeometryCollection",
                        "geometries": members.iter().map(Geometry::to_geojson).collect::<Vec<_>>()}),
                }
            }
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    position: usize,
    little_endian: bool,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], GeoError> {
        let end = self.position + N;
        let slice = self
            .bytes
            .get(self.position..end)
            .ok_or(GeoError::EndsEarly)?;
        self.position = end;
        let mut array = [0; N];
        array.copy_from_slice(slice);
        Ok(array)
    }

    fn u32(&mut self) -> Result<u32, GeoError> {
        let bytes = self.take::<4>()?;
        Ok(if self.little_endian {
            u32::from_le_bytes(bytes)
        } else {
            u32::from_be_bytes(bytes)
        })
    }

    fn f64(&mut self) -> Result<f64, GeoError> {
        let bytes = self.take::<8>()?;
        Ok(if self.little_endian {
            f64::from_le_bytes(bytes)
        } else {
            f64::from_be_bytes(bytes)
        })
    }

    /// A count of items of at least `item_bytes` each, refused when the rest cannot hold them
    /// (so that a corrupt count cannot make us allocate).
    fn count(&mut self, item_bytes: usize) -> Result<usize, GeoError> {
        let count = self.u32()? as usize;
        let rest = self.bytes.len() - self.position;
        if count.saturating_mul(item_bytes) > rest {
            return Err(GeoError::EndsEarly);
        }
        Ok(count)
    }

    fn geometry(&mut self, depth: usize, top: bool) -> Result<Geometry, GeoError> {
        if depth > MAX_DEPTH {
            return Err(GeoError::TooDeep);
        }
        self.little_endian = match self.take::<1>()?[0] {
            0 => false,
            1 => true,
            other => return Err(GeoError::ByteOrder(other)),
        };
        let code = self.u32()?;
        let mut dimensions = 2;
        if code & EWKB_Z != 0 {
            dimensions += 1;
        }
        if code & EWKB_M != 0 {
            dimensions += 1;
        }
        if code & EWKB_SRID != 0 {
            let srid = self.u32()?;
            if srid != WGS84 {
                return Err(GeoError::Srid(srid));
            }
        } else if top {
            return Err(GeoError::NoSrid);
        }
        let kind = code & 0x0FFF_FFFF;
        match kind {
            WKB_POINT => {
                let point = self.position(dimensions)?;
                if point[0].is_nan() && point[1].is_nan() {
                    return Ok(Geometry::Point(None));
                }
                Ok(Geometry::Point(Some(checked(point)?)))
            }
            WKB_LINE_STRING => Ok(Geometry::LineString(self.line(dimensions)?)),
            WKB_POLYGON => {
                let rings = self.count(4)?;
                let mut polygon = Vec::with_capacity(rings);
                for _ in 0..rings {
                    polygon.push(self.line(dimensions)?);
                }
                Ok(Geometry::Polygon(polygon))
            }
            WKB_MULTI_POINT | WKB_MULTI_LINE_STRING | WKB_MULTI_POLYGON | WKB_COLLECTION => {
                let count = self.count(5)?;
                let mut members = Vec::with_capacity(count);
                for _ in 0..count {
                    let member = self.geometry(depth + 1, false)?;
                    let fits = match (kind, &member) {
                        (WKB_MULTI_POINT, Geometry::Point(point)) => point.is_some(),
                        (WKB_MULTI_LINE_STRING, Geometry::LineString(_))
                        | (WKB_MULTI_POLYGON, Geometry::Polygon(_))
                        | (WKB_COLLECTION, _) => true,
                        _ => false,
                    };
                    if !fits {
                        return Err(GeoError::MemberMismatch(kind));
                    }
                    members.push(member);
                }
                Ok(Geometry::Collection { kind, members })
            }
            other => Err(GeoError::NoGeoJson(other)),
        }
    }

    /// One position: x and y kept, Z and M read and left out (GeoJSON positions Meilisearch
    /// indexes are longitude, latitude).
    fn position(&mut self, dimensions: usize) -> Result<Position, GeoError> {
        let x = self.f64()?;
        let y = self.f64()?;
        for _ in 2..dimensions {
            self.f64()?;
        }
        Ok([x, y])
    }

    fn line(&mut self, dimensions: usize) -> Result<Vec<Position>, GeoError> {
        let count = self.count(8 * dimensions)?;
        let mut line = Vec::with_capacity(count);
        for _ in 0..count {
            line.push(checked(self.position(dimensions)?)?);
        }
        Ok(line)
    }
}

/// A position within Meilisearch's ranges: longitude in [-180, 180], latitude in [-90, 90].
fn checked([lng, lat]: Position) -> Result<Position, GeoError> {
    if !(lng.is_finite() && (-180.0..=180.0).contains(&lng)) {
        return Err(GeoError::Longitude(lng));
    }
    if !(lat.is_finite() && (-90.0..=90.0).contains(&lat)) {
        return Err(GeoError::Latitude(lat));
    }
    Ok([lng, lat])
}

fn type_name(kind: u32) -> String {
    match kind {
        WKB_MULTI_POINT => "MultiPoint".into(),
        WKB_MULTI_LINE_STRING => "MultiLineString".into(),
        WKB_MULTI_POLYGON => "MultiPolygon".into(),
        WKB_COLLECTION => "GeometryCollection".into(),
        8 => "a CircularString".into(),
        9 => "a CompoundCurve".into(),
        10 => "a CurvePolygon".into(),
        11 => "a MultiCurve".into(),
        12 => "a MultiSurface".into(),
        15 => "a PolyhedralSurface".into(),
        16 => "a TIN".into(),
        17 => "a Triangle".into(),
        other => format!("geometry type {other}"),
    }
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    let digits = text.as_bytes();
    if !digits.len().is_multiple_of(2) || digits.is_empty() {
        return None;
    }
    let value = |digit: u8| (digit as char).to_digit(16);
    digits
        .chunks_exact(2)
        .map(|pair| Some((value(pair[0])? * 16 + value(pair[1])?) as u8))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Little-endian EWKB with SRID 4326 (as PostGIS writes it).
    fn ewkb(kind: u32, body: &[u8]) -> String {
        let mut bytes = vec![1];
        bytes.extend_from_slice(&(kind | EWKB_SRID).to_le_bytes());
        bytes.extend_from_slice(&WGS84.to_le_bytes());
        bytes.extend_from_slice(body);
        hex(&bytes)
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|byte| format!("{byte:02X}")).collect()
    }

    fn coordinates(values: &[f64]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn member(kind: u32, body: &[u8]) -> Vec<u8> {
        let mut bytes = vec![1];
        bytes.extend_from_slice(&kind.to_le_bytes());
        bytes.extend_from_slice(body);
        bytes
    }

    #[test]
    fn postgis_output_of_a_point_becomes_lat_and_lng() {
        // SELECT 'SRID=4326;POINT(2.2945 48.8584)'::geometry (and ::geography of that point)
        let text = "0101000020E61000004260E5D0225B024076711B0DE06D4840";
        let value = from_postgis_text(text).expect("a point");
        assert_eq!(
            value,
            GeoValue::Point {
                lat: 48.8584,
                lng: 2.2945
            }
        );
        let mut out = Vec::new();
        value.write_json(&mut out);
        assert_eq!(out, br#"{"lat":48.8584,"lng":2.2945}"#);
        assert_eq!(value.field(), "_geo");
    }

    #[test]
    fn big_endian_and_z_coordinates_are_read() {
        let mut bytes = vec![0];
        bytes.extend_from_slice(&(WKB_POINT | EWKB_SRID | EWKB_Z).to_be_bytes());
        bytes.extend_from_slice(&WGS84.to_be_bytes());
        for value in [10.5f64, -20.25, 300.0] {
            bytes.extend_from_slice(&value.to_be_bytes());
        }
        assert_eq!(
            from_postgis_text(&hex(&bytes)),
            Ok(GeoValue::Point {
                lat: -20.25,
                lng: 10.5
            })
        );
    }

    #[test]
    fn other_geometries_become_geojson() {
        let mut ring = 4u32.to_le_bytes().to_vec();
        ring.extend(coordinates(&[0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]));
        let mut polygon = 1u32.to_le_bytes().to_vec();
        polygon.extend(&ring);
        let value = from_postgis_text(&ewkb(WKB_POLYGON, &polygon)).expect("a polygon");
        assert_eq!(value.field(), "_geojson");
        assert_eq!(
            value,
            GeoValue::Shape(json!({"type": "Polygon",
                "coordinates": [[[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]]}))
        );

        let mut multi = 2u32.to_le_bytes().to_vec();
        multi.extend(member(WKB_POINT, &coordinates(&[1.0, 2.0])));
        multi.extend(member(WKB_POINT, &coordinates(&[3.0, 4.0])));
        assert_eq!(
            from_postgis_text(&ewkb(WKB_MULTI_POINT, &multi)),
            Ok(GeoValue::Shape(
                json!({"type": "MultiPoint", "coordinates": [[1.0, 2.0], [3.0, 4.0]]})
            ))
        );

        let mut line = 2u32.to_le_bytes().to_vec();
        line.extend(coordinates(&[1.0, 2.0, 3.0, 4.0]));
        let mut collection = 2u32.to_le_bytes().to_vec();
        collection.extend(member(WKB_POINT, &coordinates(&[5.0, 6.0])));
        collection.extend(member(WKB_LINE_STRING, &line));
        assert_eq!(
            from_postgis_text(&ewkb(WKB_COLLECTION, &collection)),
            Ok(GeoValue::Shape(
                json!({"type": "GeometryCollection", "geometries": [
                    {"type": "Point", "coordinates": [5.0, 6.0]},
                    {"type": "LineString", "coordinates": [[1.0, 2.0], [3.0, 4.0]]},
                ]})
            ))
        );
    }

    #[test]
    fn an_empty_point_is_no_location() {
        // SELECT 'SRID=4326;POINT EMPTY'::geometry, 'SRID=4326;GEOMETRYCOLLECTION EMPTY'::geometry
        let value = from_postgis_text("0101000020E6100000000000000000F87F000000000000F87F");
        assert_eq!(value, Ok(GeoValue::Empty));
        assert_eq!(
            from_postgis_text("0107000020E610000000000000"),
            Ok(GeoValue::Empty)
        );
        let mut out = Vec::new();
        GeoValue::Empty.write_json(&mut out);
        assert_eq!(out, b"null");
    }

    #[test]
    fn values_meilisearch_cannot_read_are_refused_with_the_reason() {
        let out_of_range = from_postgis_text(&ewkb(WKB_POINT, &coordinates(&[48.0, 200.0])));
        assert!(
            out_of_range
                .as_ref()
                .is_err_and(|e| e.to_string().contains("latitude 200")),
            "{out_of_range:?}"
        );
        let swapped = from_postgis_text(&ewkb(WKB_POINT, &coordinates(&[-181.0, 0.0])));
        assert!(swapped.is_err_and(|e| e.to_string().contains("longitude -181")));

        // SELECT 'SRID=3857;POINT(1 2)'::geometry
        let mercator = "0101000020110F0000000000000000F03F0000000000000040";
        assert!(from_postgis_text(mercator).is_err_and(|e| e.to_string().contains("SRID 3857")));
        // SELECT 'POINT(1 2)'::geometry
        let no_srid = "0101000000000000000000F03F0000000000000040";
        assert!(from_postgis_text(no_srid).is_err_and(|e| e.to_string().contains("no SRID")));

        let mut curve = 3u32.to_le_bytes().to_vec();
        curve.extend(coordinates(&[0.0, 0.0, 1.0, 1.0, 2.0, 0.0]));
        assert!(from_postgis_text(&ewkb(8, &curve))
            .is_err_and(|e| e.to_string().contains("CircularString")));

        for garbage in [
            "",
            "zz",
            "0101",
            "(1,2)",
            "0101000020E61000004260E5D0225B0240",
        ] {
            assert!(from_postgis_text(garbage).is_err(), "{garbage}");
        }
        // A count far beyond the bytes that follow is refused before anything is allocated.
        let mut huge = u32::MAX.to_le_bytes().to_vec();
        huge.extend(coordinates(&[0.0, 0.0]));
        assert!(from_postgis_text(&ewkb(WKB_LINE_STRING, &huge))
            .is_err_and(|e| e.to_string().contains("ends early")));
    }

    #[test]
    fn a_point_column_is_told_by_its_declared_type() {
        assert!(declared_points_only("geometry(Point,4326)"));
        assert!(declared_points_only("geography(PointZ,4326)"));
        assert!(declared_points_only("geography(Point)"));
        assert!(!declared_points_only("geometry(MultiPoint,4326)"));
        assert!(!declared_points_only("geometry"));
        assert!(!declared_points_only("geometry(Polygon,4326)"));
    }

    #[test]
    fn geo_settings_add_only_what_is_missing() {
        assert_eq!(
            missing_geo_settings(
                &json!({"filterableAttributes": ["genre"], "sortableAttributes": []})
            ),
            Some(json!({
                "filterableAttributes": ["genre", "_geo", "_geojson"],
                "sortableAttributes": ["_geo"],
            }))
        );
        assert_eq!(
            missing_geo_settings(
                &json!({"filterableAttributes": ["_geojson", "_geo"], "sortableAttributes": ["_geo", "year"]})
            ),
            None
        );
    }
}
