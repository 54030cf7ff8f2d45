//! The API key format, as a property: any key built from any random part
//! round-trips through its checksum, and any single-character change of it (at
//! any position, to any other character) is refused without a lookup.

use proptest::prelude::*;
use tollgate_core::keystore::{
    checksum, KeyKind, KeyShape, BASE62, KEY_RANDOM_LEN, SERVICE_KEY_PREFIX, USER_KEY_PREFIX,
};

fn random_part() -> impl Strategy<Value = String> {
    proptest::collection::vec(0..62usize, KEY_RANDOM_LEN)
        .prop_map(|v| v.into_iter().map(|i| BASE62[i] as char).collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_key_round_trips_and_any_one_change_is_refused(
        random in random_part(),
        service in any::<bool>(),
        at in any::<prop::sample::Index>(),
        to in any::<char>(),
    ) {
        let (prefix, kind) = if service {
            (SERVICE_KEY_PREFIX, KeyKind::Service)
        } else {
            (USER_KEY_PREFIX, KeyKind::User)
        };
        let body = format!("{prefix}{random}");
        let key = format!("{body}{}", checksum(&body));
        prop_assert_eq!(KeyShape::of(&key), Ok(KeyShape::Current(kind)));

        let mut chars: Vec<char> = key.chars().collect();
        let i = at.index(chars.len());
        prop_assume!(chars[i] != to);
        chars[i] = to;
        let changed: String = chars.into_iter().collect();
        prop_assert!(KeyShape::of(&changed).is_err(), "{} accepted", changed);
    }
}
