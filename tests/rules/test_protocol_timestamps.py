"""Pure protocol helpers."""


def test_iso_timestamps_match_javascript_to_iso_string():
    import datetime
    import random

    from relay.wire.protocol import iso_timestamp

    rng = random.Random(7)
    for _ in range(20000):
        seconds = round(rng.uniform(0, 4e9), rng.choice([0, 1, 2, 3, 6]))
        dt = datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)
        expected = dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"
        assert iso_timestamp(seconds) == expected
    assert iso_timestamp(1712345678.0) == "2024-04-05T19:34:38.000Z"
