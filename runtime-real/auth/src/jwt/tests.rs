use super::*;

fn secret(c: char) -> Secret {
    Secret::from_base64(&base64::engine::general_purpose::STANDARD.encode([c as u8; 32])).unwrap()
}

#[test]
fn minted_tokens_verify_only_for_their_pair() {
    let s = secret('a');
    let token = Signer::new(&s, GITLAB, GITLAB_KAS).token();
    assert_eq!(Verifier::new(&s, GITLAB, GITLAB_KAS).check(&token), Ok(()));
    let err = Verifier::new(&s, GITLAB_KAS, GITLAB_KAS)
        .check(&token)
        .unwrap_err();
    assert_eq!(err, "token issuer is wrong");
    let err = Verifier::new(&s, GITLAB, GITLAB).check(&token).unwrap_err();
    assert_eq!(err, "token audience is wrong");
    let err = Verifier::new(&secret('b'), GITLAB, GITLAB_KAS)
        .check(&token)
        .unwrap_err();
    assert_eq!(err, "token signature does not match the secret");
}

#[test]
fn bearer_header_is_required() {
    let s = secret('a');
    let v = Verifier::new(&s, GITLAB, GITLAB_KAS);
    assert_eq!(
        v.check_bearer(None).unwrap_err(),
        "no authorization metadata"
    );
    let token = Signer::new(&s, GITLAB, GITLAB_KAS).token();
    assert!(
        v.check_bearer(Some(&token)).is_err(),
        "a bare token lacks 'Bearer '"
    );
    assert_eq!(v.check_bearer(Some(&format!("Bearer {token}"))), Ok(()));
}

#[test]
fn secrets_must_be_base64_of_32_bytes() {
    assert!(matches!(
        Secret::from_base64("%%%"),
        Err(SecretError::Base64 { .. })
    ));
    let short = base64::engine::general_purpose::STANDARD.encode([1u8; 16]);
    assert!(matches!(
        Secret::from_base64(&short),
        Err(SecretError::TooShort { len: 16, .. })
    ));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("secret");
    std::fs::write(&path, format!("{}\n", secret('z').to_base64())).unwrap();
    assert!(Secret::load(&path).is_ok(), "a trailing newline is fine");
    let err = Secret::load(&dir.path().join("missing"))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("cannot read"), "{err}");
}

#[test]
fn future_nbf_or_iat_and_overlong_lifetimes_are_refused() {
    let v = Verifier::new(&secret('a'), GITLAB, GITLAB_KAS);
    let now = 1_000_000;
    let claims = |iat, nbf, exp| Times { iat, nbf, exp };
    assert_eq!(v.check_times(&claims(now, now, now + 60), now), Ok(()));
    assert_eq!(
        v.check_times(&claims(0, 0, now + 60), now),
        Ok(()),
        "iat, nbf optional"
    );
    assert_eq!(
        v.check_times(&claims(now + 3, now + 3, now + 60), now),
        Ok(()),
        "within the leeway"
    );
    let nbf = v.check_times(&claims(now, now + 600, now + 660), now);
    assert_eq!(
        nbf,
        Err("token is not valid yet (nbf is 600s in the future)".into())
    );
    let iat = v
        .check_times(&claims(now + 600, 0, now + 660), now)
        .unwrap_err();
    assert!(iat.contains("issued in the future"), "{iat}");
    let ten_years = v.check_times(&claims(now, now, now + 10 * 365 * 86_400), now);
    assert!(ten_years.unwrap_err().contains("exceeds the 3600s"));
    let forever = v.check_times(&claims(0, 0, u64::MAX), now);
    assert!(forever.unwrap_err().contains("exceeds"));
    let old_and_long = v.check_times(&claims(now - 7200, 0, now + 60), now);
    assert!(old_and_long.unwrap_err().contains("lifetime 7260s"));
    let strict =
        Verifier::new(&secret('a'), GITLAB, GITLAB_KAS).with_max_lifetime(Duration::from_secs(30));
    assert!(
        strict
            .check_times(&claims(now, now, now + 60), now)
            .is_err()
    );
}

#[test]
fn a_minted_token_is_used_for_ten_seconds_then_a_new_one_is_minted() {
    let signer = Signer::new(&secret('a'), GITLAB_KAS, GITLAB_KAS);
    let now = unix_now();
    let first = signer.token_at(now);
    assert_eq!(signer.clone().token_at(now + 9), first, "clones share it");
    let second = signer.token_at(now + 10);
    assert_ne!(second, first);
    assert_ne!(
        signer.token_at(now - 1),
        second,
        "a clock gone back mints anew"
    );
}

#[test]
fn a_verified_token_seen_again_is_still_refused_once_expired_and_only_it_is_remembered() {
    let s = secret('a');
    let v = Verifier::new(&s, GITLAB, GITLAB_KAS);
    let now = unix_now();
    let token = Signer::new(&s, GITLAB, GITLAB_KAS).token_at(now);
    assert_eq!(v.check_at(&token, now), Ok(()));
    assert_eq!(v.lock().len(), 1);
    assert_eq!(
        v.clone().check_at(&token, now + 65),
        Ok(()),
        "within the leeway"
    );
    assert_eq!(
        v.check_at(&token, now + 66),
        Err("token expired".into()),
        "exp is checked again"
    );
    // A token that failed verification is not remembered: it fails again.
    let forged = Signer::new(&secret('b'), GITLAB, GITLAB_KAS).token_at(now);
    for _ in 0..2 {
        let refused = v.check_at(&forged, now).unwrap_err();
        assert_eq!(refused, "token signature does not match the secret");
    }
    assert_eq!(v.lock().len(), 1);
    // Full, it forgets every token, and keeps the one it verified last.
    let key = EncodingKey::from_secret(&s.0);
    for i in 0..VERIFIED_TOKENS as u64 {
        let claims = Claims {
            iss: GITLAB.into(),
            aud: GITLAB_KAS.into(),
            exp: now + 60,
            iat: now,
            nbf: now - 10 - i,
        };
        let t = jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &key).unwrap();
        assert_eq!(v.check_at(&t, now), Ok(()));
    }
    assert_eq!(v.lock().len(), 1);
}
